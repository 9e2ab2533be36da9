"""The server's accountant: per-client extraction budgets that survive a restart.

Every token (and echoed prompt position) a client is shown is charged ``cost_t``
(:func:`scpdr.bounds.token_cost`); the log-likelihood ratio of everything a client was served,
against every constituent, is at most the sum of its charges (``docs/accountant.md``,
Proposition 1 and Corollary 2). ``--budget`` holds each response (one choice) to a number of nats
(the runtime's ``SamplingParams.budget``); ``--client-budget`` holds each API key to a number of
nats summed over all its responses in the last ``--budget-window`` seconds (no window: for the
life of the ledger).

The charges live in a ledger (:mod:`scpdr.serve.ledger`: a SQLite file by default, PostgreSQL
with ``--budget-db postgresql://...`` for replicas), keyed on the caller's key *fingerprint*
(``request.state.client``, :func:`scpdr.serve.middleware.key_fingerprint`), never the key. A
request first **reserves** what it may spend (its sequences' budgets: the client's remaining
nats, shared equally among the request's sequences, each capped by ``--budget``); when the
response is complete (or the client went away) the reservation is **settled** to what was
actually charged. A crash between the two leaves the reservation standing: a client is never
charged less than it was served.
"""

from __future__ import annotations

import logging
from pathlib import Path

from scpdr.serve.config import ServeConfig
from scpdr.serve.ledger import (
    EXHAUSTED,
    Allotment,
    BudgetExhaustedError,
    ClientUsage,
    Ledger,
    LedgerUnavailableError,
    open_ledger,
)
from scpdr.serve.ledger.sqlite import SqliteLedger

__all__ = [
    "ANONYMOUS",
    "EXHAUSTED",
    "Accountant",
    "Allotment",
    "BudgetExhaustedError",
    "BudgetStore",
    "ClientUsage",
    "default_budget_path",
    "open_config_ledger",
]

logger = logging.getLogger(__name__)

#: The client of requests without an API key (a server without ``--api-key``): one shared budget.
ANONYMOUS = "anonymous"

#: The SQLite ledger under its earlier name.
BudgetStore = SqliteLedger


def default_budget_path(model_name: str) -> Path:
    """``$SCPDR_HOME/budgets/<model id>.sqlite``: where a server keeps its clients' usage when
    ``--budget-db`` is not given (one file per served model id)."""
    from scpdr.models.embedded import scpdr_home

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name) or "model"
    return scpdr_home() / "budgets" / f"{safe}.sqlite"


def open_config_ledger(config: ServeConfig) -> Ledger | None:
    """The ledger of ``config`` (None without ``--client-budget``): ``--budget-db``, else the
    default SQLite file. Raises :class:`~scpdr.serve.ledger.LedgerUnreachableError`."""
    if config.client_budget is None:
        return None
    target = config.budget_db or default_budget_path(config.served_model_name)
    return open_ledger(
        target,
        name=config.served_model_name,
        budget=config.client_budget,
        window_s=config.budget_window,
    )


class Accountant:
    """The server's budget policy: ``response_budget`` nats per choice (``--budget``) and, with a
    :class:`~scpdr.serve.ledger.Ledger`, the client's budget (``--client-budget``) shared by its
    requests."""

    def __init__(self, response_budget: float | None, ledger: Ledger | None = None) -> None:
        self.response_budget = response_budget
        self.ledger = ledger

    @classmethod
    def from_config(cls, config: ServeConfig) -> Accountant:
        """The accountant of ``config`` (its ledger opened when a client budget is set)."""
        return cls(config.budget, open_config_ledger(config))

    def allot(self, client: str | None, sequences: int) -> Allotment:
        """Each sequence's budget for one request (raises :class:`BudgetExhaustedError`, 429, and
        :class:`~scpdr.serve.ledger.LedgerUnavailableError`, 503)."""
        if self.ledger is None:
            return Allotment([self.response_budget] * sequences)
        return self.ledger.reserve(client or ANONYMOUS, sequences, self.response_budget)

    def settle(self, client: str | None, allotment: Allotment, nats: float) -> None:
        """Charge the client what the request was served (a no-op without a client budget). A
        ledger that does not answer keeps the reservation (logged): never charged less."""
        if self.ledger is None or allotment.reservation is None:
            return
        try:
            self.ledger.settle(client or ANONYMOUS, allotment.reservation, nats)
        except LedgerUnavailableError as exc:
            logger.error("reservation %s stands unsettled: %s", allotment.reservation, exc)

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
        if self.ledger is not None:
            out.update(self.ledger.usage(client or ANONYMOUS).as_dict())
        return out

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
