"""The server's accountant: per-client extraction budgets that survive a restart.

Every token (and echoed prompt position) a client is shown is charged ``cost_t``
(:func:`scpdr.bounds.token_cost`); the log-likelihood ratio of everything a client was served,
against every constituent, is at most the sum of its charges (``docs/accountant.md``,
Proposition 1 and Corollary 2). ``--budget`` holds each response (one choice) to a number of nats
(the runtime's ``SamplingParams.budget``); ``--client-budget`` holds each API key to a number of
nats summed over all its responses in the last ``--budget-window`` seconds (no window: for the
life of the usage file).

:class:`BudgetStore` keeps the charges in a small SQLite file (WAL journal, one transaction per
change, so a crash leaves the last committed state), keyed on the caller's key *fingerprint*
(``request.state.client``, :func:`scpdr.serve.middleware.key_fingerprint`), never the key. A
request first **reserves** what it may spend (its sequences' budgets: the client's remaining
nats, shared equally among the request's sequences, each capped by ``--budget``); when the
response is complete (or the client went away) the reservation is **settled** to what was
actually charged. A crash between the two leaves the reservation standing: a client is never
charged less than it was served.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scpdr.serve.config import ServeConfig
from scpdr.serve.errors import APIError

__all__ = [
    "ANONYMOUS",
    "Accountant",
    "Allotment",
    "BudgetExhaustedError",
    "BudgetStore",
    "ClientUsage",
    "default_budget_path",
]

#: The client of requests without an API key (a server without ``--api-key``): one shared budget.
ANONYMOUS = "anonymous"
#: A client's settled rows are folded into one when it has more (no window: rows never expire).
_FOLD_AT = 64
#: Nats below which a balance counts as spent (float rounding of shares and sums).
EXHAUSTED = 1e-9

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


def default_budget_path(model_name: str) -> Path:
    """``$SCPDR_HOME/budgets/<model id>.sqlite``: where a server keeps its clients' usage when
    ``--budget-file`` is not given (one file per served model id)."""
    from scpdr.models.embedded import scpdr_home

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name) or "model"
    return scpdr_home() / "budgets" / f"{safe}.sqlite"


@dataclass(frozen=True)
class ClientUsage:
    """A client's budget now: ``spent`` nats in the window (reservations included), ``remaining``
    (``budget - spent``, at least 0) and ``refills_at`` (unix time at which some of it comes back:
    the oldest charge leaves the window; None when nothing is spent or there is no window)."""

    client: str
    budget: float
    window_s: float | None
    spent: float
    remaining: float
    refills_at: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            "object": "budget",
            "client": self.client,
            "budget": self.budget,
            "window_s": self.window_s,
            "spent": self.spent,
            "remaining": self.remaining,
            "refills_at": self.refills_at,
        }


class BudgetExhaustedError(APIError):
    """A client over its budget: HTTP 429 naming the budget and when it refills."""

    def __init__(self, usage: ClientUsage, now: float) -> None:
        per = f" per {usage.window_s:g} s" if usage.window_s is not None else ""
        if usage.refills_at is None:
            when = "it does not refill (no --budget-window)"
            self.retry_after: float | None = None
        else:
            wait = max(0.0, usage.refills_at - now)
            self.retry_after = wait
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(usage.refills_at))
            when = f"it refills at {stamp} (in {math.ceil(wait)} s)"
        super().__init__(
            f"this API key's extraction budget of {usage.budget:g} nats{per} is spent "
            f"({usage.spent:.4g} nats charged); {when}. GET /v1/budget shows the balance",
            status=429,
            type="insufficient_quota",
            code="budget_exceeded",
        )
        self.usage = usage

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


@dataclass(frozen=True)
class Allotment:
    """What one request may spend: each sequence's budget (None: unlimited) and the store's
    reservation (None without a client budget)."""

    budgets: list[float | None]
    reservation: int | None = None


class BudgetStore:
    """Per-client charges in SQLite (``path``; parent directories are created).

    Args:
        path: the usage file (``":memory:"`` for a store that does not persist).
        budget: nats each client may spend per window.
        window_s: the window in seconds; None = the budget never refills.
        clock: the time source (unix seconds; tests pass their own).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        budget: float,
        window_s: float | None = None,
        clock: object = time.time,
    ) -> None:
        if not budget >= 0 or math.isinf(budget):
            raise ValueError(f"budget must be a finite number of nats >= 0, got {budget!r}")
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds (or None), got {window_s!r}")
        self.budget = float(budget)
        self.window_s = None if window_s is None else float(window_s)
        self.clock = clock
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit mode: every change below is its own explicit BEGIN IMMEDIATE ... COMMIT
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _now(self) -> float:
        return float(self.clock())  # type: ignore[operator]

    def _rows(self, client: str, now: float) -> list[tuple[float, float]]:
        """``(ts, nats)`` of the client's charges in the window, oldest first."""
        since = -math.inf if self.window_s is None else now - self.window_s
        cur = self._db.execute(
            "SELECT ts, nats FROM charges WHERE client = ? AND ts > ? ORDER BY ts, id",
            (client, since),
        )
        return [(float(ts), float(n)) for ts, n in cur.fetchall()]

    def _usage(self, client: str, now: float) -> ClientUsage:
        rows = self._rows(client, now)
        spent = math.fsum(n for _, n in rows)
        refills = None
        if self.window_s is not None and rows:
            left = spent
            for ts, n in rows:  # the time at which enough leaves the window to be under budget
                left -= n
                refills = ts + self.window_s
                if left < self.budget - EXHAUSTED:
                    break
        return ClientUsage(
            client, self.budget, self.window_s, spent, max(0.0, self.budget - spent), refills
        )

    def usage(self, client: str) -> ClientUsage:
        """The client's balance now."""
        with self._lock:
            return self._usage(client, self._now())

    def reserve(self, client: str, sequences: int, cap: float | None) -> Allotment:
        """Reserve the request's budget: ``sequences`` equal shares of the client's remaining
        nats, each at most ``cap`` (the per-response budget).

        Raises:
            BudgetExhaustedError: nothing remains (429).
        """
        if sequences < 1:
            raise ValueError("a request has at least one sequence")
        with self._lock:
            now = self._now()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                usage = self._usage(client, now)
                if usage.remaining <= EXHAUSTED:
                    raise BudgetExhaustedError(usage, now)
                share = usage.remaining / sequences
                each = share if cap is None else min(share, cap)
                cur = self._db.execute(
                    "INSERT INTO charges (client, ts, nats, settled) VALUES (?, ?, ?, 0)",
                    (client, now, each * sequences),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return Allotment([each] * sequences, cur.lastrowid)

    def settle(self, client: str, reservation: int, nats: float) -> None:
        """Replace a reservation by what the request was actually charged."""
        nats = float(nats)
        if not nats >= 0:  # NaN or negative: keep the reservation (never charge less)
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "UPDATE charges SET nats = MIN(nats, ?), settled = 1 WHERE id = ?",
                    (nats, reservation),
                )
                self._fold(client)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _fold(self, client: str) -> None:
        """Without a window rows never expire: fold a client's settled rows into one."""
        if self.window_s is not None:
            self._db.execute(
                "DELETE FROM charges WHERE ts <= ?", (self._now() - 2 * self.window_s,)
            )
            return
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM charges WHERE client = ? AND settled = 1", (client,)
        ).fetchone()
        if count < _FOLD_AT:
            return
        total, first = self._db.execute(
            "SELECT TOTAL(nats), MIN(ts) FROM charges WHERE client = ? AND settled = 1", (client,)
        ).fetchone()
        self._db.execute("DELETE FROM charges WHERE client = ? AND settled = 1", (client,))
        self._db.execute(
            "INSERT INTO charges (client, ts, nats, settled) VALUES (?, ?, ?, 1)",
            (client, first, total),
        )


class Accountant:
    """The server's budget policy: ``response_budget`` nats per choice (``--budget``) and, with a
    :class:`BudgetStore`, the client's budget (``--client-budget``) shared by its requests."""

    def __init__(self, response_budget: float | None, store: BudgetStore | None = None) -> None:
        self.response_budget = response_budget
        self.store = store

    @classmethod
    def from_config(cls, config: ServeConfig) -> Accountant:
        """The accountant of ``config`` (its usage file opened when a client budget is set)."""
        store = None
        if config.client_budget is not None:
            path = config.budget_file or default_budget_path(config.served_model_name)
            store = BudgetStore(path, budget=config.client_budget, window_s=config.budget_window)
        return cls(config.budget, store)

    def allot(self, client: str | None, sequences: int) -> Allotment:
        """Each sequence's budget for one request (raises :class:`BudgetExhaustedError`)."""
        if self.store is None:
            return Allotment([self.response_budget] * sequences)
        return self.store.reserve(client or ANONYMOUS, sequences, self.response_budget)

    def settle(self, client: str | None, allotment: Allotment, nats: float) -> None:
        """Charge the client what the request was served (a no-op without a client budget)."""
        if self.store is not None and allotment.reservation is not None:
            self.store.settle(client or ANONYMOUS, allotment.reservation, nats)

    def balance(self, client: str | None) -> dict[str, object]:
        """``GET /v1/budget``: the per-response budget and the client's balance (nulls when the
        server sets no client budget)."""
        out: dict[str, object] = {
            "object": "budget",
            "client": client or ANONYMOUS,
            "response_budget": self.response_budget,
            "budget": None,
            "window_s": None,
            "spent": None,
            "remaining": None,
            "refills_at": None,
        }
        if self.store is not None:
            out.update(self.store.usage(client or ANONYMOUS).as_dict())
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
