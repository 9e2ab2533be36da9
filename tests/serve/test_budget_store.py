"""``serve/budget.py``'s store on its own, with a fake clock: shares, settling, the window and its
refill time, a crash between reserve and settle, folding, and the config checks."""

from __future__ import annotations

import sqlite3

import pytest

from scpdr.errors import ConfigError
from scpdr.serve.budget import Accountant, BudgetExhaustedError, BudgetStore
from scpdr.serve.config import ServeConfig


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_shares_settle_and_exhaust(tmp_path):
    store = BudgetStore(tmp_path / "u.db", budget=10.0)
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


def test_window_refills_and_names_when(tmp_path):
    clock = Clock()
    store = BudgetStore(tmp_path / "u.db", budget=5.0, window_s=100.0, clock=clock)
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


def test_a_crash_between_reserve_and_settle_keeps_the_reservation(tmp_path):
    path = tmp_path / "u.db"
    store = BudgetStore(path, budget=10.0)
    a = store.reserve("c", 2, cap=None)
    store.settle("c", a.reservation, 1.5)
    store.reserve("c", 1, cap=4.0)  # the process dies here: never settled
    del store  # no close: as after a crash
    again = BudgetStore(path, budget=10.0)
    assert again.usage("c").spent == pytest.approx(5.5)  # charged the whole reservation
    # the file is a plain SQLite database in WAL mode (a reader sees committed rows only)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = db.execute("SELECT client, nats, settled FROM charges ORDER BY id").fetchall()
    assert rows == [("c", 1.5, 1), ("c", 4.0, 0)]


def test_settled_rows_fold_without_a_window(tmp_path):
    store = BudgetStore(tmp_path / "u.db", budget=1000.0)
    for _ in range(70):
        a = store.reserve("c", 1, cap=1.0)
        store.settle("c", a.reservation, 0.5)
    assert store.usage("c").spent == pytest.approx(35.0)
    with sqlite3.connect(tmp_path / "u.db") as db:
        (n,) = db.execute("SELECT COUNT(*) FROM charges").fetchone()
    assert n < 70


def test_accountant_from_config_and_the_options_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    acc = Accountant.from_config(ServeConfig(client_budget=3.0, model_name="my/model"))
    assert acc.store is not None and acc.store.path.endswith("budgets/my_model.sqlite")
    acc.close()
    assert Accountant.from_config(ServeConfig(budget=1.0)).allot(None, 3).budgets == [1.0] * 3
    for bad, option in (
        ({"budget_window": 10.0}, "--budget-window"),
        ({"client_budget": 1.0, "budget_window": 0.0}, "--budget-window"),
        ({"budget_file": "x.db"}, "--budget-file"),
        ({"budget": -1.0}, "--budget"),
        ({"budget": float("inf")}, "--budget"),
        ({"api_key": "a,,b"}, "--api-key"),
    ):
        with pytest.raises(ConfigError, match=option):
            ServeConfig(**bad)
    assert ServeConfig(api_key=" a , b ").api_keys == ("a", "b")
