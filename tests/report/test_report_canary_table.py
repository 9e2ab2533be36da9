"""canary_table: methods ranked per column; the random baseline an unmarked row below them."""

from __future__ import annotations

from scpdr.report.tables import canary_table


def _row(method, reps, metric, value):
    return {
        "method": method,
        "attack": "canary",
        "metric": metric,
        "value": value,
        "repetitions": reps,
        "corpus": "c",
    }


def test_canary_table_marks_methods_and_appends_the_random_baseline():
    rows = [
        _row("none", 3, "mean", 9.0),
        _row("none", 3, "p95", 12.0),
        _row("cp-delta", 3, "mean", 4.0),
        _row("cp-delta", 3, "p95", 5.0),
        _row("scp-delta-r-b", 3, "mean", 1.0),
        _row("scp-delta-r-b", 3, "p95", 2.0),
        _row("cp-kl", 3, "mean", None),  # no values: no row
        _row("none-val", 0, "mean", 0.5),
        _row("none-val", 0, "p95", 0.75),
    ]
    t = canary_table(rows)
    assert t is not None
    assert t.row_keys == ["none", "cp-delta", "scp-delta-r-b", "baseline"]
    assert t.row_labels[-1] == "Random baseline" and t.separator_before == 3
    assert t.marks("scp-delta-r-b") == ["best", "best"]
    assert t.marks("cp-delta") == ["second", "second"]
    assert t.marks("none") == [None, None]
    # the baseline is lower than every method but is a reference row: never marked
    assert t.marks("baseline") == [None, None]
    assert [t.value("baseline", j) for j in range(2)] == [0.5, 0.75]


def test_canary_table_without_a_baseline_has_no_separator():
    t = canary_table([_row("none", 1, "mean", 2.0), _row("cp-delta", 1, "mean", 1.0)])
    assert t is not None and t.row_keys == ["none", "cp-delta"] and t.separator_before is None
    assert canary_table([_row("none", 0, "mean", 2.0)]) is None  # no inserted canaries
