"""The audit in the report: intervals in every cell, the mark of cells indistinguishable from No
CP-val, a plain-language verdict per method, each table's note printed once in the HTML."""

from __future__ import annotations

from scpdr.methods import label
from scpdr.report import ReportInputs, main_table, render_report, verdicts
from scpdr.report.cells import NEAR_CHANCE, format_ci


def _row(method, attack, metric, value, half, **extra):
    return {
        "method": method,
        "attack": attack,
        "metric": metric,
        "value": value,
        "ci_low": value - half,
        "ci_high": value + half,
        "n": 50,
        "corpus": "ids",
        **extra,
    }


def _rows():
    return [
        _row("none", "pii", "fer", 1.0, 0.02),
        _row("scp-delta-r-b", "pii", "fer", 0.02, 0.02),
        _row("none-val", "pii", "fer", 0.0, 0.02),
        _row("none", "tte", "acc", 0.9, 0.05),
        _row("scp-delta-r-b", "tte", "acc", 0.55, 0.05),
        _row("none-val", "tte", "acc", 0.3, 0.05),
        _row("none", "utility", "accuracy", 0.32, 0.01),
        _row("scp-delta-r-b", "utility", "accuracy", 0.31, 0.01),
        _row("none", "loss", "auc", 1.0, 0.0, population="canaries", n_members=100),
        _row("scp-delta-r-b", "loss", "auc", 0.55, 0.05, population="canaries", n_members=100),
        _row("scp-delta-r-b", "ref", "auc", 0.3, 0.05, population="canaries", n_members=100),
        _row("scp-delta-r-b", "ref", "tpr@0.01fpr", 0.0, 0.0, population="canaries"),
        _row("none-val", "loss", "auc", 0.5, 0.06, population="canaries", n_members=100),
        _row("none-val", "ref", "auc", 0.5, 0.06, population="canaries", n_members=100),
    ]


def test_cells_show_the_interval_and_mark_what_is_at_chance():
    assert format_ci(0.6, 0.48, 0.72) == ".60 ±.12"
    assert format_ci(0.6, None, None) == ".60"
    t = main_table(_rows())
    cols = [(c.attack, c.label) for c in t.columns]
    fer = cols.index(("pii", "FER"))
    scp = t.cells[t.row_keys.index("scp-delta-r-b")]
    assert scp[fer].text == ".02 ±.02" + NEAR_CHANCE  # within No CP-val's interval
    none = t.cells[t.row_keys.index("none")]
    assert none[fer].text == "1.0 ±.02"  # far from it
    assert none[cols.index(("utility", "ACC"))].text == ".32 ±.01"  # utility: never marked


def test_verdicts_say_what_leaks_in_plain_language():
    lines = verdicts(_rows())
    assert [ln.split(":")[0] for ln in lines] == [label("none"), label("scp-delta-r-b")]
    none, scp = lines
    assert "above chance on PII FER 1.0 [.98, 1.0] vs 0" in none
    assert "membership detectable" in none
    assert "at chance on PII" in scp
    assert "above chance on TTE ACC .55 [.50, .60] vs .30" in scp
    # the strongest membership test is the one farthest from .5, here a flipped one (AUC .3)
    assert "strongest test Ref (base), AUC .30 [.25, .35]" in scp and "detectable" in scp
    assert "next-token accuracy .31 vs No CP .32 (not distinguishable)" in scp


def test_html_prints_each_note_once_and_the_verdicts(tmp_path):
    rep = render_report(ReportInputs(rows=_rows(), title="t"), tmp_path, draw=False)
    page = rep.html.read_text()
    for table in rep.tables.values():
        for note in table.notes:
            first = note.split(";")[0].replace("'", "&#x27;")[:60]
            assert page.count(first) == 1, note
    assert "Verdicts" in page and "membership detectable" in page
    md = rep.markdown.read_text()
    assert "## Membership inference" in md and "- " + verdicts(_rows())[0] in md
    assert "mia" in rep.tables
