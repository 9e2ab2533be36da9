"""The clients' budget ledger behind one interface (:class:`Ledger`), with two backends:

- :class:`~scpdr.serve.ledger.sqlite.SqliteLedger`: a SQLite file (the default; one host);
- :class:`~scpdr.serve.ledger.postgres.PostgresLedger`: PostgreSQL (``--budget-db
  postgresql://...``; any number of replicas on any number of hosts).

:func:`open_ledger` picks the backend from ``--budget-db``: a ``postgresql://`` (or
``postgres://``) URL, else a file path. ``docs/accountant.md`` ("In the server") has the
semantics both share.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from scpdr.serve.config import is_postgres_url
from scpdr.serve.ledger.base import (
    EXHAUSTED,
    Allotment,
    BudgetExhaustedError,
    ClientUsage,
    Ledger,
    LedgerUnavailableError,
    LedgerUnreachableError,
)

__all__ = [
    "EXHAUSTED",
    "Allotment",
    "BudgetExhaustedError",
    "ClientUsage",
    "Ledger",
    "LedgerUnavailableError",
    "LedgerUnreachableError",
    "is_postgres_url",
    "open_ledger",
]


def open_ledger(
    target: str | os.PathLike[str],
    *,
    name: str,
    budget: float,
    window_s: float | None = None,
    clock: Callable[[], float] | None = None,
) -> Ledger:
    """The ledger at ``target`` (a ``postgresql://`` URL or a SQLite path) for ``budget`` nats
    per ``window_s`` seconds; ``name`` (the served model id) names its rows in PostgreSQL.

    Raises:
        LedgerUnreachableError: the database cannot be reached or the file opened.
    """
    if is_postgres_url(target):
        from scpdr.serve.ledger.postgres import PostgresLedger

        return PostgresLedger(str(target), name=name, budget=budget, window_s=window_s, clock=clock)
    from scpdr.serve.ledger.sqlite import SqliteLedger

    return SqliteLedger(target, budget=budget, window_s=window_s, clock=clock)
