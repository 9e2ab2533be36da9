"""report.md / report.html rendering on hand-made rows: every figure with data is drawn and
embedded, every figure without data is omitted with a note, the HTML is self-contained."""

from __future__ import annotations

import re

import numpy as np

from scpdr.report import ReportInputs, render_report


def _rows() -> list[dict]:
    rows = []
    vals = {
        "none": (20.0, 9.5, 0.9, 0.45),
        "cp-delta-r": (3.0, 2.0, 0.7, 0.44),
        "scp-delta-r-b": (1.0, 0.3, 0.6, 0.44),
    }
    for m, (canary, ael, auc, acc) in vals.items():
        rows += [
            {"method": m, "attack": "canary", "metric": "mean", "value": canary, "corpus": "ids"},
            {"method": m, "attack": "pii", "metric": "ael", "value": ael, "corpus": "ids"},
            {"method": m, "attack": "tte", "metric": "auc", "value": auc, "corpus": "ids"},
            {"method": m, "attack": "utility", "metric": "acc", "value": acc, "corpus": "ids"},
        ]
    rows.append(
        {
            "method": "none-val",
            "attack": "pii",
            "metric": "ael",
            "value": 0.2,
            "n": 16,
            "std": 0.4,
            "corpus": "ids",
        }
    )
    for m in ("cp-delta-r", "scp-delta-r-b"):
        rows.append(
            {"method": m, "attack": "bounds", "metric": "k_x_p99", "value": 0.5, "corpus": "ids"}
        )
    return rows


def test_full_report_embeds_every_figure(tmp_path):
    rng = np.random.default_rng(0)
    rows = _rows()
    for m in (1, 10, 100, 1000):
        rows.append(
            {
                "method": "scp-delta-r-b",
                "attack": "canary",
                "metric": "mean",
                "value": np.log(m),
                "corpus": "ids",
                "sweep": "m",
                "sweep_value": m,
            }
        )
    for e in (1, 5, 10):
        rows.append(
            {
                "method": "none",
                "attack": "tte",
                "metric": "auc",
                "value": 0.5 + e / 30,
                "corpus": "ids",
                "sweep": "train.epochs",
                "sweep_value": e,
            }
        )
    dist = {
        "ids": {
            q: {
                "cp-delta-r": rng.lognormal(0, 1, 200),
                "scp-delta-r-b": np.r_[0.0, rng.lognormal(-4, 1, 199)],
            }
            for q in ("k_x", "t_x", "t_x_rare", "v_x", "v_x_rare")
        }
    }
    curve = {"fpr": [0, 0.01, 1], "tpr": [0, 0.6, 1], "auc": 0.9}
    roc = {"ids": {"loss": {"none": curve}, "lira": {"none": curve, "scp-delta-r-b": curve}}}
    gens = [
        {
            "corpus": "ids",
            "prompt": "Name: A | B, ID:",
            "reference": " 0123456789",
            "outputs": {"none": " 0123456789", "scp-delta-r-b": " 31"},
        }
    ]
    rep = render_report(
        ReportInputs(
            rows=rows,
            title="T <demo>",
            corpus_labels={"ids": "IDs"},
            distributions=dist,
            roc=roc,
            generations=gens,
            config_text="name: demo\n",
        ),
        tmp_path,
    )
    for name in ("kx_hist", "tx_vx_hist", "exposure_vs_m", "tte_vs_epochs", "mia_roc_ids"):
        path = rep.figures[name]
        assert path is not None and path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = rep.markdown.read_text()
    assert "![" in md and "(plots/kx_hist.png)" in md and "Omitted" not in md
    assert "**1.0**" in md  # best canary mean (SCP-Δr-b) in bold
    assert "Name: A \\| B, ID:" in md  # pipes escaped inside table cells
    page = rep.html.read_text()
    srcs = re.findall(r"src='([^']*)'", page)
    assert len(srcs) == 5 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "href=" not in page and "<script" not in page  # self-contained, nothing external
    assert "T &lt;demo&gt;" in page and "<b>1.0</b>" in page
    assert "No CP-val" in page and "STE" in page and "NAS" in page


def test_figures_without_data_are_omitted_with_a_note(tmp_path):
    rep = render_report(ReportInputs(rows=_rows(), title="t"), tmp_path)
    assert all(p is None for p in rep.figures.values())
    md = rep.markdown.read_text()
    assert md.count("_Omitted:") == 6  # 5 figures + generations
    assert "no sweep over m" in md and "no membership-inference results" in md
    assert not (tmp_path / "plots").exists()
    assert "data:image" not in rep.html.read_text()
    # The k_x table still comes from the rows.
    assert "k_x bounds (99th percentile)" in md


def test_plots_disabled(tmp_path):
    dist = {"ids": {"k_x": {"cp-delta-r": [0.1, 0.2, 0.3]}}}
    rep = render_report(ReportInputs(rows=_rows(), distributions=dist), tmp_path, draw=False)
    assert rep.figures["kx_hist"] is None
    assert "plots disabled" in rep.markdown.read_text()
