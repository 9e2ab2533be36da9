"""`scpdr eval` with no options: attack sizes and methods that fit a CPU run, and --m sweeps."""

from __future__ import annotations

import pytest

from scpdr import methods
from scpdr.attacks.eval_data import EvalData
from scpdr.attacks.secrets import secret_targets
from scpdr.commands.eval import CPU_METHODS, auto_methods, parse_ms
from scpdr.data import Record
from scpdr.errors import ConfigError


def _data(n: int, length: int) -> EvalData:
    recs = [
        Record.make(
            id=f"r{i}",
            text=f"record {i} " + "x" * length + f" secret{i:05d} end",
            secrets=[f"secret{i:05d}"],
        )
        for i in range(n)
    ]
    return EvalData(
        train=[r.text for r in recs],
        validation=[r.text for r in recs[:10]],
        members=recs,
        secrets=secret_targets(recs, partition=0),
    )


def test_a_small_evaluation_runs_the_main_table_and_a_large_one_no_cp_and_scp_b():
    assert auto_methods(_data(4, 20), device="cpu") == list(methods.MAIN_TABLE_METHODS)
    big = auto_methods(_data(200, 150), device="cpu")
    assert big == list(CPU_METHODS)
    assert [methods.SPECS[n].label for n in big] == ["No CP", "SCP-Δr-b"]
    assert auto_methods(_data(200, 150), device="cuda") == list(methods.MAIN_TABLE_METHODS)


def test_m_takes_one_value_or_a_sweep():
    assert parse_ms(None) is None and parse_ms("10") == [10]
    assert parse_ms("1,3,10,30") == [1, 3, 10, 30] and parse_ms("3,3") == [3]
    for bad in ("a", "0,3", ","):
        with pytest.raises(ConfigError, match="--m"):
            parse_ms(bad)
