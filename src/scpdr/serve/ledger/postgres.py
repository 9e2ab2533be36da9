"""The ledger in PostgreSQL (psycopg 3): one ledger for replicas on any number of hosts.

Two tables, created on first use (``CREATE ... IF NOT EXISTS`` under an advisory lock, so
replicas starting together do not race): ``scpdr_budget_clients`` (one row per ledger and
client: the lock) and ``scpdr_budget_charges`` (the charges). A reservation is one transaction:
``SELECT ... FOR UPDATE`` on the client's row, then the sum of its charges, then the new row, then
``COMMIT``; a second replica reserving for the same client waits at the ``FOR UPDATE`` until the
first commits, and its sum (READ COMMITTED: each statement sees every commit before it) includes
the first's reservation. Two replicas can therefore never both spend a client's last nats.

Rows carry the ledger's name (the served model id), so one database holds the ledgers of several
models. Time is the database server's clock (``clock_timestamp()``), one clock for every replica
(replicas' own clocks may disagree; a ``clock`` argument replaces it in tests). A connection
lost while serving is reopened once; if the database still does not answer the request fails
with 503 (:class:`~scpdr.serve.ledger.base.LedgerUnavailableError`) — nothing is served without
the ledger. A retried reservation whose first commit did reach the database is reserved twice
(the client is over-charged, never under-charged).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from scpdr.serve.ledger.base import Ledger, LedgerUnavailableError, LedgerUnreachableError

__all__ = ["PostgresLedger", "redact_url"]

T = TypeVar("T")

_FOLD_AT = 64
#: pg_advisory_xact_lock key of the schema creation ("scpdr" in ASCII).
_SCHEMA_LOCK = 0x7363706472
#: Seconds a statement waits for a client's lock before the attempt fails (a stuck replica).
LOCK_TIMEOUT_S = 10

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS scpdr_budget_clients (
        ledger TEXT NOT NULL,
        client TEXT NOT NULL,
        PRIMARY KEY (ledger, client)
    )""",
    """CREATE TABLE IF NOT EXISTS scpdr_budget_charges (
        id BIGSERIAL PRIMARY KEY,
        ledger TEXT NOT NULL,
        client TEXT NOT NULL,
        ts DOUBLE PRECISION NOT NULL,
        nats DOUBLE PRECISION NOT NULL,
        settled BOOLEAN NOT NULL DEFAULT FALSE
    )""",
    """CREATE INDEX IF NOT EXISTS scpdr_budget_charges_client_ts
        ON scpdr_budget_charges (ledger, client, ts)""",
)


def redact_url(url: str) -> str:
    """``url`` without its password (in the netloc or a ``password=`` parameter)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = urlencode(
        [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)], safe="*/"
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class PostgresLedger(Ledger):
    """Per-client charges in the PostgreSQL database at ``url`` under the ledger ``name``.

    Raises:
        LedgerUnreachableError: psycopg is missing, or the database cannot be reached or the
            tables created (the message names the URL without its password, and the fix).
    """

    def __init__(
        self,
        url: str,
        *,
        name: str,
        budget: float,
        window_s: float | None = None,
        clock: Callable[[], float] | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(budget=budget, window_s=window_s, clock=clock)
        self.url, self.name = url, name
        self.location = redact_url(url)
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._conn: Any = None
        try:
            import psycopg
        except ImportError:
            raise LedgerUnreachableError(
                f"--budget-db {self.location} needs psycopg 3: pip install 'scpdr[postgres]' "
                "(or 'psycopg[binary]')"
            ) from None
        self._errors = (psycopg.OperationalError, psycopg.InterfaceError)
        try:
            conn = self._connection()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in _SCHEMA:
                    conn.execute(statement)
        except psycopg.Error as exc:
            self._drop()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LedgerUnreachableError(
                f"cannot use the budget ledger at {self.location} ({reason}); start PostgreSQL "
                "there or fix --budget-db (the server does not start without its ledger)"
            ) from None

    def _connection(self) -> Any:
        import psycopg

        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=max(1, math.ceil(self.connect_timeout_s)),
                application_name="scpdr-serve",
            )
            self._conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT_S}s'")
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # a broken connection may fail to close: it is dropped either way
                pass
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _transact(self, client: str, body: Callable[[Any], T], *, lock: bool) -> T:
        with self._lock:
            for attempt in range(2):  # a lost connection is reopened once
                try:
                    conn = self._connection()
                    with conn.transaction():
                        if lock:
                            key = (self.name, client)
                            conn.execute(
                                "INSERT INTO scpdr_budget_clients (ledger, client) "
                                "VALUES (%s, %s) ON CONFLICT DO NOTHING",
                                key,
                            )
                            conn.execute(
                                "SELECT 1 FROM scpdr_budget_clients "
                                "WHERE ledger = %s AND client = %s FOR UPDATE",
                                key,
                            )
                        return body(conn)
                except self._errors as exc:
                    self._drop()
                    if attempt == 1:
                        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                        raise LedgerUnavailableError(
                            self.location, reason or type(exc).__name__
                        ) from exc
        raise AssertionError("unreachable")

    def _now(self, tx: Any) -> float:
        if self.clock is not None:
            return float(self.clock())
        (now,) = tx.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        return float(now)

    def _rows(self, tx: Any, client: str, since: float) -> list[tuple[float, float]]:
        cur = tx.execute(
            "SELECT ts, nats FROM scpdr_budget_charges "
            "WHERE ledger = %s AND client = %s AND ts > %s ORDER BY ts, id",
            (self.name, client, since),
        )
        return [(float(ts), float(n)) for ts, n in cur.fetchall()]

    def _insert(self, tx: Any, client: str, ts: float, nats: float) -> int:
        (row,) = tx.execute(
            "INSERT INTO scpdr_budget_charges (ledger, client, ts, nats, settled) "
            "VALUES (%s, %s, %s, %s, FALSE) RETURNING id",
            (self.name, client, ts, nats),
        ).fetchone()
        return int(row)

    def _settle_row(self, tx: Any, row: int, nats: float) -> None:
        tx.execute(
            "UPDATE scpdr_budget_charges SET nats = LEAST(nats, %s), settled = TRUE "
            "WHERE id = %s AND ledger = %s",
            (nats, row, self.name),
        )

    def _fold(self, tx: Any, client: str, now: float) -> None:
        key = (self.name, client)
        if self.window_s is not None:
            tx.execute(
                "DELETE FROM scpdr_budget_charges WHERE ledger = %s AND client = %s AND ts <= %s",
                (*key, now - 2 * self.window_s),
            )
            return
        rows = tx.execute(
            "SELECT ts, nats FROM scpdr_budget_charges "
            "WHERE ledger = %s AND client = %s AND settled",
            key,
        ).fetchall()
        if len(rows) < _FOLD_AT:
            return
        tx.execute(
            "DELETE FROM scpdr_budget_charges WHERE ledger = %s AND client = %s AND settled", key
        )
        tx.execute(
            "INSERT INTO scpdr_budget_charges (ledger, client, ts, nats, settled) "
            "VALUES (%s, %s, %s, %s, TRUE)",
            (*key, min(float(t) for t, _ in rows), math.fsum(float(n) for _, n in rows)),
        )
