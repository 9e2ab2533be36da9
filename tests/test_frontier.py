"""The privacy–utility frontier (``scpdr.report.frontier``) on hand-made rows: one point per
setting (the strongest test's TPR@1%), the Pareto set, the figure."""

from __future__ import annotations

from scpdr.report.frontier import frontier_plot, frontier_points, pareto, pareto_text


def _rows(method, tprs, acc, **extra):
    out = [
        {"method": method, "attack": "budget", "metric": f"{t}_tpr@0.01fpr", "value": v,
         "ci_low": v / 2, "ci_high": min(1.0, v * 2), **extra}
        for t, v in tprs.items()
    ]  # fmt: skip
    out.append({"method": method, "attack": "budget", "metric": "accuracy", "value": acc,
                "ci_low": acc - 0.01, "ci_high": acc + 0.01, **extra})  # fmt: skip
    return out


ROWS = [
    *_rows("scp-delta-r-b", {"ref": 0.06, "lira": 0.04}, 0.32, mode="stop", budget=None),
    *_rows("scp-delta-r-b", {"ref": 0.02, "lira": 0.03}, 0.06, mode="stop", budget=5.0),
    *_rows("scp-delta-r-b", {"ref": 0.02, "loss": 0.01}, 0.30, mode="fallback", budget=5.0),
    *_rows("scp-delta-r-b", {"ref": 0.05}, 0.31, mode="anchor", budget=None, anchor=1.0),
    *_rows("scp-delta-r-b", {"ref": 0.08}, 0.29, mode="anchor", budget=None, anchor=2.0),
    # the plain suite's rows of a method: attack = the test, metric = tpr@0.01fpr
    {"method": "none", "attack": "lira", "metric": "tpr@0.01fpr", "value": 0.74},
    {"method": "none", "attack": "ref", "metric": "tpr@0.01fpr", "value": 0.96},
    {"method": "none", "attack": "utility", "metric": "accuracy", "value": 0.33},
    {"method": "cp-delta-r", "attack": "ref", "metric": "tpr@0.01fpr", "value": 0.34},  # no acc
]


def test_points_take_the_strongest_test_and_every_setting():
    pts = {p.label: p for p in frontier_points(ROWS)}
    assert len(pts) == 6  # CP-Δr has no accuracy row: no point
    stop5 = next(p for lab, p in pts.items() if "stop" in lab and "B = 5" in lab)
    assert stop5.test == "lira" and stop5.tpr == 0.03 and stop5.tpr_high == 0.06
    assert any("B = ∞" in lab for lab in pts) and any("c = 2" in lab for lab in pts)
    none = next(p for p in pts.values() if p.test == "ref" and p.tpr == 0.96)
    assert none.tpr_low == none.tpr_high == 0.96  # no interval given: the value itself


def test_pareto_set_of_a_hand_made_example():
    front = pareto(frontier_points(ROWS))
    # fallback B=5 (.02, .30) dominates stop B=5 (.03, .06); anchor c=1 (.05, .31);
    # stop ∞ (.06, .32); none (.96, .33); anchor c=2 (.08, .29) is dominated by stop ∞
    assert [(p.tpr, p.accuracy) for p in front] == [
        (0.02, 0.30),
        (0.05, 0.31),
        (0.06, 0.32),
        (0.96, 0.33),
    ]
    text = pareto_text(frontier_points(ROWS))
    assert "fallback · B = 5" in text and "c = 2" not in text
    assert pareto_text([]).startswith("No setting")


def test_figure_is_written(tmp_path):
    out = frontier_plot(ROWS, tmp_path / "frontier.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert frontier_plot(ROWS[-1:], tmp_path / "none.png") is None


def test_the_report_draws_the_frontier_with_the_sweep(tmp_path):
    from scpdr.report import ReportInputs, render_report

    rep = render_report(ReportInputs(rows=ROWS), tmp_path)
    md = rep.markdown.read_text()
    assert rep.figures["frontier"] is not None and rep.figures["frontier"].exists()
    assert "plots/frontier.png" in md and "Pareto set" in md and "fallback · B = 5" in md


def test_each_sweep_point_is_its_own_setting():
    rows = []
    for k, tpr, acc in ((2, 0.06, 0.32), (4, 0.03, 0.30)):
        tag = {"sweep": "partitions.k", "sweep_value": k}
        rows += [
            {"method": "scp-delta-r-b", "attack": "ref", "metric": "tpr@0.01fpr", "value": tpr,
             **tag},
            {"method": "scp-delta-r-b", "attack": "utility", "metric": "accuracy", "value": acc,
             **tag},
        ]  # fmt: skip
    pts = {p.label: p for p in frontier_points(rows)}
    assert sorted(pts) == ["SCP-Δr-b · partitions.k = 2", "SCP-Δr-b · partitions.k = 4"]
    assert pts["SCP-Δr-b · partitions.k = 4"].tpr == 0.03
