"""The budget ledger on its own, each test on both backends (a SQLite file and a PostgreSQL
database), with a fake clock: shares, settling, the window and its refill time, a crash between
reserve and settle, folding; then what only PostgreSQL has (replicas racing for the last nats,
ledgers named per model, an unreachable or lost database) and the config checks."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from scpdr.errors import ConfigError
from scpdr.serve.budget import Accountant, BudgetExhaustedError
from scpdr.serve.config import ServeConfig
from scpdr.serve.ledger import (
    LedgerUnavailableError,
    LedgerUnreachableError,
    is_postgres_url,
    open_ledger,
)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path) -> str:
    """Where the ledger lives: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "u.db")
    return request.getfixturevalue("pg_url")


def _rows(db: str) -> list[tuple[str, float, bool]]:
    """``(client, nats, settled)`` of every charge row, read from the database itself."""
    if is_postgres_url(db):
        import psycopg

        with psycopg.connect(db) as conn:
            rows = conn.execute(
                "SELECT client, nats, settled FROM scpdr_budget_charges ORDER BY id"
            ).fetchall()
        return [(c, n, bool(s)) for c, n, s in rows]
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT client, nats, settled FROM charges ORDER BY id").fetchall()
    return [(c, n, bool(s)) for c, n, s in rows]


def test_shares_settle_and_exhaust(db):
    store = open_ledger(db, name="m", budget=10.0)
    a = store.reserve("c", 4, cap=2.0)
    assert a.budgets == [2.0] * 4  # capped by the per-response budget
    assert store.usage("c").spent == 8.0  # reserved until settled
    store.settle("c", a.reservation, 3.0)
    assert store.usage("c").spent == 3.0 and store.usage("c").remaining == 7.0
    b = store.reserve("c", 2, cap=None)
    assert b.budgets == [3.5, 3.5]
    store.settle("c", b.reservation, 100.0)  # never more than reserved
    assert store.usage("c").remaining == 0.0
    with pytest.raises(BudgetExhaustedError) as info:
        store.reserve("c", 1, cap=None)
    assert info.value.status == 429 and info.value.headers() == {}  # no window: never refills
    assert "does not refill" in info.value.message and "10 nats" in info.value.message
    assert store.usage("other").remaining == 10.0  # per client
    store.close()


def test_window_refills_and_names_when(db):
    clock = Clock()
    store = open_ledger(db, name="m", budget=5.0, window_s=100.0, clock=clock)
    for spend in (2.0, 3.0):
        a = store.reserve("c", 1, cap=None)
        store.settle("c", a.reservation, spend)
        clock.t += 10
    usage = store.usage("c")
    assert usage.remaining == 0.0
    assert usage.refills_at == 1_000_000.0 + 100.0  # the first charge leaves the window
    with pytest.raises(BudgetExhaustedError) as info:
        store.reserve("c", 1, cap=None)
    assert info.value.headers() == {"Retry-After": "80"}
    assert "per 100 s" in info.value.message and "in 80 s" in info.value.message
    clock.t = 1_000_000.0 + 100.5  # the 2-nat charge has left the window
    assert store.usage("c").remaining == pytest.approx(2.0)
    clock.t += 10  # and now the 3-nat one
    assert store.usage("c").remaining == pytest.approx(5.0) and store.usage("c").spent == 0.0
    store.close()


def test_a_crash_between_reserve_and_settle_keeps_the_reservation(db):
    store = open_ledger(db, name="m", budget=10.0)
    a = store.reserve("c", 2, cap=None)
    store.settle("c", a.reservation, 1.5)
    store.reserve("c", 1, cap=4.0)  # the process dies here: never settled
    del store  # no close: as after a crash
    again = open_ledger(db, name="m", budget=10.0)
    assert again.usage("c").spent == pytest.approx(5.5)  # charged the whole reservation
    assert _rows(db) == [("c", 1.5, True), ("c", 4.0, False)]
    again.close()
    if not is_postgres_url(db):  # a plain SQLite file in WAL mode (readers see commits only)
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_settled_rows_fold_without_a_window(db):
    store = open_ledger(db, name="m", budget=1000.0)
    for _ in range(70):
        a = store.reserve("c", 1, cap=1.0)
        store.settle("c", a.reservation, 0.5)
    assert store.usage("c").spent == pytest.approx(35.0)
    assert len(_rows(db)) < 70
    store.close()


def test_two_replicas_never_both_spend_the_last_nats(pg_url):
    """Four ledgers on one database (four replicas), two threads each, race for the budgets of
    ten clients: every reservation is granted from what the others left, so no client's charges
    sum past its budget (without the client's row lock, some do)."""
    budget, clients = 2.0, [f"c{k}" for k in range(10)]
    ledgers = [open_ledger(pg_url, name="m", budget=budget) for _ in range(4)]
    charged: dict[str, list[float]] = {c: [] for c in clients}
    refused: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        ledger = ledgers[i % len(ledgers)]
        for j in range(60):
            client = clients[(i + j) % len(clients)]
            try:
                a = ledger.reserve(client, 1 + j % 2, cap=0.3)
            except BudgetExhaustedError:
                with lock:
                    refused.append(client)
                continue
            # most use all they were granted (a double grant would then overspend), some half
            spent = sum(a.budgets) * (0.5 if j % 5 == 4 else 1.0)
            ledger.settle(client, a.reservation, spent)
            with lock:
                charged[client].append(spent)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(refused) == set(clients)  # every budget ran out while the replicas raced
    for client in clients:
        usage = ledgers[0].usage(client)
        assert usage.spent == pytest.approx(sum(charged[client]), abs=1e-9)
        assert usage.spent <= budget + 1e-9, client
    for ledger in ledgers:
        ledger.close()


def test_a_reservation_waits_for_the_client_lock_and_sees_what_the_holder_spent(pg_url):
    """Another replica holds the client's row lock and spends the whole budget: a reservation
    made meanwhile waits for its commit, then sees the spend and is refused (never granted from
    the balance before it)."""
    import psycopg

    ledger = open_ledger(pg_url, name="m", budget=5.0)
    ledger.usage("c")  # the tables exist
    outcome: list[object] = []
    with psycopg.connect(pg_url) as other:  # a transaction, as the other replica's reserve
        other.execute(
            "INSERT INTO scpdr_budget_clients (ledger, client) VALUES ('m', 'c') "
            "ON CONFLICT DO NOTHING"
        )
        other.execute(
            "SELECT 1 FROM scpdr_budget_clients WHERE ledger = 'm' AND client = 'c' FOR UPDATE"
        )

        def reserve() -> None:
            try:
                outcome.append(ledger.reserve("c", 1, cap=None))
            except BudgetExhaustedError as exc:
                outcome.append(exc)

        t = threading.Thread(target=reserve)
        t.start()
        t.join(1.0)
        assert t.is_alive() and not outcome  # waiting at the lock
        other.execute(
            "INSERT INTO scpdr_budget_charges (ledger, client, ts, nats, settled) "
            "VALUES ('m', 'c', extract(epoch FROM clock_timestamp()), 5.0, FALSE)"
        )
        other.commit()
        t.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], BudgetExhaustedError)
    assert ledger.usage("c").spent == 5.0
    ledger.close()


def test_postgres_ledgers_are_named_per_model_and_schema_creation_races(pg_url):
    openers: list[object] = []

    def open_one(name: str) -> None:
        openers.append(open_ledger(pg_url, name=name, budget=5.0))

    threads = [threading.Thread(target=open_one, args=(f"m{i % 2}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(openers) == 4  # four replicas creating the tables at once: no error
    a = open_ledger(pg_url, name="model-a", budget=5.0)
    b = open_ledger(pg_url, name="model-b", budget=5.0)
    a.settle("c", a.reserve("c", 1, cap=None).reservation, 4.0)
    assert a.usage("c").spent == 4.0 and b.usage("c").spent == 0.0
    for ledger in [a, b, *openers]:
        ledger.close()  # type: ignore[attr-defined]


def test_an_unreachable_database_is_a_clear_error_without_the_password():
    with pytest.raises(LedgerUnreachableError) as info:
        open_ledger("postgresql://alice:s3cret@127.0.0.1:1/ledger", name="m", budget=1.0)
    message = str(info.value)
    assert "s3cret" not in message and "alice:***@127.0.0.1:1/ledger" in message
    assert "--budget-db" in message and "does not start" in message
    with pytest.raises(LedgerUnreachableError, match="--budget-db"):
        open_ledger("/proc/no/such/dir/u.db", name="m", budget=1.0)


def test_a_lost_connection_is_reopened_and_a_lost_database_is_a_503(pg_url):
    import psycopg

    ledger = open_ledger(pg_url, name="m", budget=10.0)
    ledger.reserve("c", 1, cap=1.0)
    with psycopg.connect(pg_url, autocommit=True) as admin:  # the server drops the connection
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'scpdr-serve'"
        )
    assert ledger.reserve("c", 1, cap=1.0).budgets == [1.0]  # reopened: served
    assert ledger.usage("c").spent == 2.0
    maintenance = pg_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(maintenance, autocommit=True) as admin:  # the database goes away
        admin.execute(f"DROP DATABASE {pg_url.rsplit('/', 1)[1]} WITH (FORCE)")
    with pytest.raises(LedgerUnavailableError) as info:
        ledger.reserve("c", 1, cap=1.0)
    assert info.value.status == 503 and info.value.code == "ledger_unavailable"
    acc = Accountant(None, ledger)
    allotment = type("A", (), {"reservation": 1, "budgets": [1.0]})()
    acc.settle("c", allotment, 0.5)  # settling against a lost ledger: logged, not raised
    ledger.close()


def test_accountant_from_config_and_the_options_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    acc = Accountant.from_config(ServeConfig(client_budget=3.0, model_name="my/model"))
    assert acc.ledger is not None and acc.ledger.location.endswith("budgets/my_model.sqlite")
    acc.close()
    assert Accountant.from_config(ServeConfig(budget=1.0)).allot(None, 3).budgets == [1.0] * 3
    for bad, option in (
        ({"budget_window": 10.0}, "--budget-window"),
        ({"client_budget": 1.0, "budget_window": 0.0}, "--budget-window"),
        ({"budget_db": "x.db"}, "--budget-db"),
        ({"budget": -1.0}, "--budget"),
        ({"budget": float("inf")}, "--budget"),
        ({"api_key": "a,,b"}, "--api-key"),
        ({"replicas": 0}, "--replicas"),
        ({"address": ""}, "--address"),
    ):
        with pytest.raises(ConfigError, match=option):
            ServeConfig(**bad)
    assert ServeConfig(api_key=" a , b ").api_keys == ("a", "b")


def test_replicas_with_a_client_budget_refuse_a_sqlite_ledger_and_say_why():
    for settings in (
        {"replicas": 2, "client_budget": 5.0},
        {"replicas": 2, "client_budget": 5.0, "budget_db": "/shared/u.sqlite"},
        {"address": "auto", "client_budget": 5.0},
    ):
        with pytest.raises(ConfigError) as info:
            ServeConfig(**settings)
        message = str(info.value)
        assert "--budget-db" in message and "PostgreSQL" in message
        assert "N times its budget" in message
    ok = ServeConfig(replicas=2, client_budget=5.0, budget_db="postgresql://u@h/db")
    assert ok.uses_ray and not ServeConfig().uses_ray
    assert ServeConfig(replicas=3).uses_ray  # no client budget: no ledger to share
