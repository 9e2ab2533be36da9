"""The ledger in one SQLite file (the default; processes on one host).

WAL journal, ``synchronous=FULL``, every change one ``BEGIN IMMEDIATE ... COMMIT`` (SQLite's
write lock is the client lock: the whole file's, so reservations of every client are serialized,
across threads and processes on the host that holds the file). A crash leaves the last committed
state. Not for replicas on several hosts: a file on a network filesystem does not give SQLite's
locks their meaning, and a file per host is a budget per host (use
:mod:`~scpdr.serve.ledger.postgres`).
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from scpdr.serve.ledger.base import Ledger, LedgerUnreachableError

__all__ = ["SqliteLedger"]

T = TypeVar("T")

#: A client's settled rows are folded into one when it has more (no window: rows never expire).
_FOLD_AT = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    client TEXT NOT NULL,
    ts REAL NOT NULL,
    nats REAL NOT NULL,
    settled INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS charges_client_ts ON charges (client, ts);
"""


class SqliteLedger(Ledger):
    """Per-client charges in the SQLite file ``path`` (parent directories are created;
    ``":memory:"``: a ledger that does not persist).

    Raises:
        LedgerUnreachableError: the file cannot be created or opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        budget: float,
        window_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(budget=budget, window_s=window_s, clock=clock)
        self.path = self.location = str(path)
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            # autocommit mode: every change is its own explicit BEGIN IMMEDIATE ... COMMIT
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerUnreachableError(
                f"cannot open the budget ledger {self.path} ({exc}); pass a writable file to "
                "--budget-db"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transact(self, client: str, body: Callable[[Any], T], *, lock: bool) -> T:
        with self._lock:
            if not lock:
                return body(self._db)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = body(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return out

    def _rows(self, tx: Any, client: str, since: float) -> list[tuple[float, float]]:
        cur = tx.execute(
            "SELECT ts, nats FROM charges WHERE client = ? AND ts > ? ORDER BY ts, id",
            (client, since),
        )
        return [(float(ts), float(n)) for ts, n in cur.fetchall()]

    def _insert(self, tx: Any, client: str, ts: float, nats: float) -> int:
        cur = tx.execute(
            "INSERT INTO charges (client, ts, nats, settled) VALUES (?, ?, ?, 0)",
            (client, ts, nats),
        )
        return int(cur.lastrowid)

    def _settle_row(self, tx: Any, row: int, nats: float) -> None:
        tx.execute("UPDATE charges SET nats = MIN(nats, ?), settled = 1 WHERE id = ?", (nats, row))

    def _fold(self, tx: Any, client: str, now: float) -> None:
        if self.window_s is not None:
            tx.execute("DELETE FROM charges WHERE ts <= ?", (now - 2 * self.window_s,))
            return
        (count,) = tx.execute(
            "SELECT COUNT(*) FROM charges WHERE client = ? AND settled = 1", (client,)
        ).fetchone()
        if count < _FOLD_AT:
            return
        rows = tx.execute(
            "SELECT ts, nats FROM charges WHERE client = ? AND settled = 1", (client,)
        ).fetchall()
        tx.execute("DELETE FROM charges WHERE client = ? AND settled = 1", (client,))
        tx.execute(
            "INSERT INTO charges (client, ts, nats, settled) VALUES (?, ?, ?, 1)",
            (client, min(float(t) for t, _ in rows), math.fsum(float(n) for _, n in rows)),
        )
