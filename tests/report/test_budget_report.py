"""The budget sweep's table and figure (``scpdr.report.budget``)."""

from __future__ import annotations

import math

import pytest

from scpdr import methods as M
from scpdr.report.budget import budget_plot, budget_table, certified_tpr
from scpdr.report.formats import to_markdown

SCP = M.canonical("scp-delta-r")


def _row(method, budget, metric, value, lo=None, hi=None):
    return {
        "method": method,
        "attack": "budget",
        "metric": metric,
        "value": value,
        "n": 10,
        "corpus": "ids",
        "budget": budget,
        "ci_low": lo,
        "ci_high": hi,
    }


ROWS = [
    _row(m, b, metric, v, lo, hi)
    for m in ("none", SCP)
    for b in (1.0, 5.0, None)
    for metric, v, lo, hi in (
        ("lira_tpr@0.01fpr", 0.02 if b else 0.4, 0.0, 0.5),
        ("ref_tpr@0.01fpr", 0.01, 0.0, 0.2),
        ("pii_fer", 0.0 if b else 0.3, 0.0, 0.5),
        ("tokens_per_answer", {1.0: 2.0, 5.0: 9.0, None: 32.0}[b], 1.0, 40.0),
        ("accuracy", 0.1, 0.05, 0.2),
    )
]


def test_certified_line():
    assert certified_tpr(1.0) == pytest.approx(math.e * 0.01)
    assert certified_tpr(5.0) == 1.0 and certified_tpr(None) == 1.0 and certified_tpr(1e6) == 1.0


def test_table_has_a_row_per_method_and_budget_with_intervals():
    table = budget_table([*ROWS, {"method": "none", "attack": "pii", "metric": "fer", "value": 1}])
    assert table is not None
    assert len(table.row_labels) == 6 and table.row_labels[2].endswith("B = ∞")
    md = to_markdown(table)
    assert "LiRA TPR@1%" in md and "[0, .50]" in md and "tokens / answer" in md
    assert table.value(f"ids/{SCP}/1.0", 0) == pytest.approx(certified_tpr(1.0))
    assert table.value(f"ids/{SCP}/None", 6) == 32.0
    assert budget_table([{"attack": "pii", "method": "none", "metric": "fer", "value": 0}]) is None


def test_plot_is_written(tmp_path):
    path = budget_plot(ROWS, tmp_path / "budget.png")
    assert path is not None and path.stat().st_size > 10_000
    assert budget_plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_the_report_shows_the_sweep_and_its_figure(tmp_path):
    from scpdr.report import ReportInputs, render_report

    main = [
        {"method": m, "attack": "pii", "metric": "fer", "value": 0.5, "n": 10, "corpus": "ids"}
        for m in ("none", SCP)
    ]
    rep = render_report(ReportInputs(rows=[*main, *ROWS]), tmp_path)
    md = rep.markdown.read_text()
    assert "## Extraction budget" in md and "B = ∞" in md
    assert rep.figures["budget"] is not None and rep.figures["budget"].exists()
    assert "plots/budget.png" in md
    # the main table does not read the sweep's rows
    assert "tokens / answer" not in md.split("## Extraction budget")[0]

    without = render_report(ReportInputs(rows=main), tmp_path / "plain")
    text = without.markdown.read_text()
    assert "Extraction budget" not in text and "budget" not in without.figures
