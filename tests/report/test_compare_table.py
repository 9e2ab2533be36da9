"""The "Against the DP baselines" table on hand-made rows: the strongest membership test is chosen
per method (highest TPR@1%, ties to the AUC farther from .5), only methods present get a row,
every cell carries its interval, and the report shows the table only when the run has DP rows."""

from __future__ import annotations

from scpdr.methods import label
from scpdr.report import ReportInputs, render_report
from scpdr.report.cells import format_ci
from scpdr.report.compare_table import compare_table, strongest_test

DP8 = "dp-eps8"
SCP = "scp-delta-r-b"


def _row(method, attack, metric, value, half=0.05, corpus="ids", **extra):
    return {
        "method": method,
        "attack": attack,
        "metric": metric,
        "value": value,
        "ci_low": value - half,
        "ci_high": value + half,
        "n": 100,
        "corpus": corpus,
        **extra,
    }


def _mia(method, loss, ref):
    """(TPR@1%, AUC) of LOSS and of Ref for ``method``."""
    out = []
    for attack, (tpr, auc) in (("loss", loss), ("ref", ref)):
        out += [
            _row(method, attack, "tpr@0.01fpr", tpr, 0.02, n_nonmembers=200),
            _row(method, attack, "auc", auc, 0.04, n_nonmembers=200),
        ]
    return out


def _rows(*, dp=True):
    rows = [
        _row("none", "pii", "fer", 0.9),
        _row("none", "canary", "mean", 20.0, 2.0),
        _row("none", "tte", "acc", 0.8),
        _row("none", "utility", "accuracy", 0.40, 0.01),
        *_mia("none", loss=(0.30, 0.90), ref=(0.10, 0.95)),  # LOSS strongest by TPR, not AUC
        _row(SCP, "pii", "fer", 0.02, 0.02),
        _row(SCP, "canary", "mean", 1.0, 0.5),
        _row(SCP, "tte", "acc", 0.4),
        _row(SCP, "utility", "accuracy", 0.38, 0.01),
        *_mia(SCP, loss=(0.01, 0.52), ref=(0.01, 0.45)),  # a tie: Ref's AUC is farther from .5
        _row("none-val", "pii", "fer", 0.0, 0.02),
        _row("none-val", "tte", "acc", 0.3),
        *_mia("none-val", loss=(0.01, 0.50), ref=(0.02, 0.51)),
    ]
    if dp:
        rows += [
            _row(DP8, "pii", "fer", 0.05, 0.03),
            _row(DP8, "canary", "mean", 2.0, 1.0),
            _row(DP8, "utility", "accuracy", 0.30, 0.01),  # no TTE row: "-"
            *_mia(DP8, loss=(0.02, 0.55), ref=(0.08, 0.60)),  # Ref strongest
            # a sweep point is not the main run: never shown
            _row(DP8, "pii", "fer", 0.99, sweep="m", sweep_value=10),
        ]
    return rows


def _cell(table, method, group, lab):
    j = next(i for i, c in enumerate(table.columns) if c.group == group and c.label == lab)
    return table.cells[table.row_keys.index(method)][j].text


def test_the_strongest_test_is_chosen_per_method():
    rows = _rows()
    assert strongest_test(rows, method="none", corpus="ids") == "loss"
    assert strongest_test(rows, method=DP8, corpus="ids") == "ref"
    assert strongest_test(rows, method=SCP, corpus="ids") == "ref"  # the tie
    assert strongest_test(rows, method="dp-eps1", corpus="ids") is None
    t = compare_table(rows)
    assert _cell(t, "none", "Strongest MIA", "test") == "LOSS"
    assert _cell(t, DP8, "Strongest MIA", "test") == "Ref (base)"
    # the TPR and the AUC are the chosen test's own
    assert _cell(t, "none", "Strongest MIA", "TPR@1%") == format_ci(0.30, 0.28, 0.32)
    assert _cell(t, "none", "Strongest MIA", "AUC") == format_ci(0.90, 0.86, 0.94)
    assert _cell(t, DP8, "Strongest MIA", "TPR@1%") == format_ci(0.08, 0.06, 0.10)
    assert _cell(t, DP8, "Strongest MIA", "AUC") == format_ci(0.60, 0.56, 0.64)
    assert any("highest TPR at 1% FPR" in n for n in t.notes)
    assert any("intervals" in n for n in t.notes)


def test_rows_are_the_methods_present_then_no_cp_val():
    t = compare_table(_rows())
    assert t.row_keys == ["none", DP8, SCP, "none-val"]  # no dp-eps1 nor SCP+DP8 rows
    assert t.row_labels == [label(k) for k in t.row_keys]
    assert t.separator_before == 3
    assert t.title == "Against the DP baselines"
    assert [(c.group, c.label) for c in t.columns] == [
        ("PII", "FER"),
        ("Canary", "Mean"),
        ("TTE", "ACC"),
        ("Strongest MIA", "test"),
        ("Strongest MIA", "TPR@1%"),
        ("Strongest MIA", "AUC"),
        ("Utility", "ACC"),
    ]
    assert all(c.sub == "" for c in t.columns)  # one corpus: no corpus sub-header


def test_cells_carry_the_interval_and_a_missing_value_is_a_dash():
    t = compare_table(_rows())
    assert _cell(t, DP8, "PII", "FER") == ".05 ±.03"  # the main run's row, not the sweep's .99
    assert _cell(t, SCP, "Canary", "Mean") == "1.0 ±.50"
    assert _cell(t, "none", "Utility", "ACC") == ".40 ±.01"
    assert _cell(t, DP8, "TTE", "ACC") == "-"
    assert _cell(t, "none-val", "Canary", "Mean") == "-"
    assert _cell(t, "none-val", "Strongest MIA", "test") == "Ref (base)"


def test_no_table_without_a_dp_row():
    assert compare_table(_rows(dp=False)) is None
    sweep_only = [*_rows(dp=False), _row(DP8, "pii", "fer", 0.1, sweep="m", sweep_value=1)]
    assert compare_table(sweep_only) is None


def test_several_corpora_get_a_column_each():
    rows = [*_rows(), _row("none", "tte", "acc", 0.7, corpus="code")]
    t = compare_table(rows, corpus_labels={"ids": "IDs", "code": "Code"})
    tte = [c.sub for c in t.columns if c.group == "TTE"]
    assert tte == ["IDs", "Code"]
    assert {c.sub for c in t.columns} == {"IDs", "Code"}


def test_the_report_shows_the_table_only_with_dp_rows(tmp_path):
    rep = render_report(ReportInputs(rows=_rows(), title="t"), tmp_path, draw=False)
    md = rep.markdown.read_text()
    assert "## Against the DP baselines" in md
    section = md.split("## Against the DP baselines")[1].split("\n## ")[0]
    assert f"| {label(DP8)} |" in section and "Ref (base)" in section
    assert format_ci(0.08, 0.06, 0.10) in section
    page = rep.html.read_text()
    assert "Against the DP baselines" in page
    for note in rep.tables["compare"].notes:  # each note once, under the table
        assert page.count(note[:60].replace("'", "&#x27;")) == 1, note
    assert "compare" in rep.tables
    plain = render_report(ReportInputs(rows=_rows(dp=False), title="t"), tmp_path / "p", draw=False)
    assert "Against the DP baselines" not in plain.markdown.read_text()
    assert "compare" not in plain.tables
