"""The budget ledger's one interface (:class:`Ledger`) and what its backends share.

A ledger keeps each client's charges (rows ``(ts, nats, settled)`` keyed on the client's key
*fingerprint*, never the key) and answers three questions: how much a client has left
(:meth:`Ledger.usage`), may a request run and with how much (:meth:`Ledger.reserve`: the
client's remaining nats, shared equally among the request's sequences, each capped by the
per-response budget, written as one unsettled row), and what did it cost (:meth:`Ledger.settle`:
the row becomes what the request was served, never more than reserved). A reservation is one
transaction that holds the client's lock from reading the balance to writing the row, so two
requests — in two threads, two processes or two hosts — never both spend the same nats; a crash
between reserve and settle leaves the reservation standing (a client is never charged less than
it was served: ``docs/accountant.md``).

Backends (:mod:`~scpdr.serve.ledger.sqlite`, :mod:`~scpdr.serve.ledger.postgres`) implement the
storage steps of :class:`Ledger`; the balance arithmetic is here, once.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from scpdr.errors import ConfigError
from scpdr.serve.errors import APIError

__all__ = [
    "EXHAUSTED",
    "Allotment",
    "BudgetExhaustedError",
    "ClientUsage",
    "Ledger",
    "LedgerUnavailableError",
    "LedgerUnreachableError",
]

#: Nats below which a balance counts as spent (float rounding of shares and sums).
EXHAUSTED = 1e-9

T = TypeVar("T")


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


class LedgerUnavailableError(APIError):
    """The ledger stopped answering while serving: HTTP 503 (nothing is served without it)."""

    def __init__(self, location: str, reason: str) -> None:
        super().__init__(
            f"the budget ledger ({location}) is unavailable ({reason}); nothing is served "
            "without it: retry later",
            status=503,
            type="server_error",
            code="ledger_unavailable",
        )


class LedgerUnreachableError(ConfigError):
    """The ledger cannot be opened at start: the server refuses to start (exit code 2)."""


@dataclass(frozen=True)
class Allotment:
    """What one request may spend: each sequence's budget (None: unlimited) and the ledger's
    reservation (None without a client budget)."""

    budgets: list[float | None]
    reservation: int | None = None


def usage_of(
    client: str, rows: list[tuple[float, float]], budget: float, window_s: float | None
) -> ClientUsage:
    """A client's :class:`ClientUsage` from its ``(ts, nats)`` rows in the window, oldest first."""
    spent = math.fsum(n for _, n in rows)
    refills = None
    if window_s is not None and rows:
        left = spent
        for ts, n in rows:  # the time at which enough leaves the window to be under budget
            left -= n
            refills = ts + window_s
            if left < budget - EXHAUSTED:
                break
    return ClientUsage(client, budget, window_s, spent, max(0.0, budget - spent), refills)


class Ledger(ABC):
    """Per-client charges against ``budget`` nats per ``window_s`` seconds (None: the budget never
    refills). ``clock``: unix seconds (tests pass their own; None: the backend's clock).

    A backend implements :meth:`_transact` (one transaction, with the client's lock when asked)
    and the storage steps :meth:`_now`, :meth:`_rows`, :meth:`_insert`, :meth:`_settle_row`,
    :meth:`_fold`, each given the transaction's handle.
    """

    #: Where the ledger lives, for messages (a path, or a URL without its password).
    location: str

    def __init__(
        self, *, budget: float, window_s: float | None = None, clock: Callable[[], float] | None
    ) -> None:
        if not budget >= 0 or math.isinf(budget):
            raise ValueError(f"budget must be a finite number of nats >= 0, got {budget!r}")
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds (or None), got {window_s!r}")
        self.budget = float(budget)
        self.window_s = None if window_s is None else float(window_s)
        self.clock = clock

    # ---- the interface -----------------------------------------------------------------------

    def usage(self, client: str) -> ClientUsage:
        """The client's balance now."""

        def body(tx: Any) -> ClientUsage:
            now = self._now(tx)
            return usage_of(client, self._rows(tx, client, self._since(now)), *self._terms)

        return self._transact(client, body, lock=False)

    def reserve(self, client: str, sequences: int, cap: float | None) -> Allotment:
        """Reserve the request's budget: ``sequences`` equal shares of the client's remaining
        nats, each at most ``cap`` (the per-response budget).

        Raises:
            BudgetExhaustedError: nothing remains (429).
            LedgerUnavailableError: the ledger does not answer (503).
        """
        if sequences < 1:
            raise ValueError("a request has at least one sequence")

        def body(tx: Any) -> Allotment:
            now = self._now(tx)
            usage = usage_of(client, self._rows(tx, client, self._since(now)), *self._terms)
            if usage.remaining <= EXHAUSTED:
                raise BudgetExhaustedError(usage, now)
            share = usage.remaining / sequences
            each = share if cap is None else min(share, cap)
            row = self._insert(tx, client, now, each * sequences)
            return Allotment([each] * sequences, row)

        return self._transact(client, body, lock=True)

    def settle(self, client: str, reservation: int, nats: float) -> None:
        """Replace a reservation by what the request was actually charged (never more than the
        reservation; NaN or a negative charge keeps the reservation)."""
        nats = float(nats)
        if not nats >= 0:
            return

        def body(tx: Any) -> None:
            self._settle_row(tx, reservation, nats)
            self._fold(tx, client, self._now(tx))

        self._transact(client, body, lock=True)

    @abstractmethod
    def close(self) -> None:
        """Release the connection (the ledger's rows stay)."""

    # ---- what a backend implements -------------------------------------------------------------

    @abstractmethod
    def _transact(self, client: str, body: Callable[[Any], T], *, lock: bool) -> T:
        """Run ``body(tx)`` in one transaction (holding ``client``'s lock when ``lock``) and
        commit; roll back if it raises."""

    @abstractmethod
    def _rows(self, tx: Any, client: str, since: float) -> list[tuple[float, float]]:
        """``(ts, nats)`` of the client's rows with ``ts > since``, oldest first."""

    @abstractmethod
    def _insert(self, tx: Any, client: str, ts: float, nats: float) -> int:
        """Write an unsettled row; return its id."""

    @abstractmethod
    def _settle_row(self, tx: Any, row: int, nats: float) -> None:
        """Row ``row`` becomes ``min(its nats, nats)``, settled."""

    @abstractmethod
    def _fold(self, tx: Any, client: str, now: float) -> None:
        """Keep the table small: drop rows the window no longer counts, or (no window) fold the
        client's settled rows into one."""

    def _now(self, tx: Any) -> float:
        """The time of the transaction (unix seconds): the clock's."""
        return float((self.clock or time.time)())

    # ---- helpers -----------------------------------------------------------------------------

    @property
    def _terms(self) -> tuple[float, float | None]:
        return self.budget, self.window_s

    def _since(self, now: float) -> float:
        return -math.inf if self.window_s is None else now - self.window_s

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
