"""The default number of partitions: 4 where every partition gets at least 20 training records
(the K sweep of docs/experiments.md), else 2; `scpdr partition` and `scpdr train` use it when no
K is given and say which they chose and why; an explicit K always wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from scpdr.cli import main
from scpdr.data import DEFAULT_K, default_k, default_k_reason, prepare_partitions
from scpdr.data.partition import MIN_RECORDS_PER_PARTITION, load_partitions


@pytest.mark.parametrize(
    ("n", "k"), [(2, 2), (40, 2), (79, 2), (80, 4), (81, 4), (453, 4), (10_000, 4)]
)
def test_default_k_is_four_from_twenty_records_per_partition(n, k):
    assert DEFAULT_K == 4 and MIN_RECORDS_PER_PARTITION == 20
    assert default_k(n) == k
    reason = default_k_reason(n)
    assert reason.startswith(f"K = {k}") and str(n) in reason
    assert ("too few" in reason) == (k == 2)


def test_prepare_partitions_uses_the_default_only_without_k():
    big = prepare_partitions("names2ids", n_train=80, n_val=2)
    assert big.pset.k == 4 and big.k_reason is not None and "K = 4" in big.k_reason
    assert all(len(p) >= MIN_RECORDS_PER_PARTITION for p in big.pset.parts)
    small = prepare_partitions("names2ids", n_train=40, n_val=2)
    assert small.pset.k == 2 and "too few" in small.k_reason
    given = prepare_partitions("names2ids", n_train=80, n_val=2, k=2)
    assert given.pset.k == 2 and given.k_reason is None


def test_scpdr_partition_prints_the_chosen_k(tmp_path: Path, capsys):
    out = tmp_path / "p"
    assert (
        main(["partition", "names2ids", "--n-train", "80", "--n-val", "2", "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert load_partitions(out).k == 4
    assert "K = 4, the default" in printed and "in 4 partitions" in printed
    small = tmp_path / "s"
    assert (
        main(["partition", "names2ids", "--n-train", "30", "--n-val", "2", "--out", str(small)])
        == 0
    )
    assert load_partitions(small).k == 2 and "too few" in capsys.readouterr().out
