"""``report.md`` and a self-contained ``report.html`` (images embedded as base64) from result rows
and the bound / ROC / generation artifacts of a run.

The report is a list of blocks (heading, paragraph, table, figure, code) rendered twice, so the
Markdown and HTML versions always say the same thing. A figure without data is replaced by a note
saying why it was omitted.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scpdr import methods as M
from scpdr.attacks.mia import MIA_LABELS
from scpdr.io import atomic_write_text
from scpdr.report import plots
from scpdr.report.budget import budget_plot, budget_table
from scpdr.report.compare_table import compare_table
from scpdr.report.frontier import frontier_plot, frontier_points, pareto_text
from scpdr.report.recommend import operating_points_text
from scpdr.report.tables import (
    Table,
    canary_table,
    generations_table,
    kx_table,
    main_table,
    mia_table,
    to_html,
    to_markdown,
)
from scpdr.report.verdicts import verdicts

__all__ = ["READING_GUIDE", "RenderedReport", "ReportInputs", "render_report"]

READING_GUIDE = (
    "Each row is one way of serving the fine-tuned model. *No CP* is the model fine-tuned on the "
    "first partition, served as is; the CP rows aggregate the K constituents (each trained on a "
    "disjoint partition) with a NAF rule; *SCP-Δr-b* / *-c* smooth every constituent towards the "
    "base model (b) or a constant vector (c) before CP-Δr. *No CP-val* attacks No CP with "
    "examples it never saw: the level an attack reaches without memorization. *STE* is the "
    "standard error of the No CP-val values. Columns: **Canary** = exposure in bits of inserted "
    "random-word canaries (Carlini et al. 2019; 0 ≈ chance); **PII** = Names2IDs extraction, AEL "
    "= average number of leading ID digits extracted, FER = fraction of IDs fully extracted; "
    "**TTE** = token-by-token extraction of training text, AUC of the accuracy–coverage curve "
    "and accuracy when every greedy token is accepted; **Utility** = next-token accuracy on "
    "held-out data (higher is better); **NAS** = the attack columns min-max normalized over the "
    "rows and averaged (0 = least leakage among the rows). A protected method works when its "
    "attack columns are close to No CP-val while its utility stays close to No CP. Every number "
    "comes with half its 95% bootstrap interval (±); a cell marked ° is not distinguishable from "
    "No CP-val at 95%. **Membership inference** asks a different question: not whether the "
    "training data can be reproduced, but whether one can tell that an example was trained on "
    "(ROC AUC .5 = chance, either side of it is leakage). Every attack reads only what a fresh "
    "request returns (the TDE game, paper Def. 4.2; docs/attacks.md)."
)


@dataclass
class ReportInputs:
    """Everything a report is made of.

    ``distributions``: corpus → quantity (``"k_x"``, ``"t_x"``, ``"t_x_rare"``, ``"v_x"``,
    ``"v_x_rare"``) → method → per-position values. ``roc``: corpus → MIA attack → method →
    ``{"fpr", "tpr", "auc"}``. ``generations``: ``{"corpus", "prompt", "reference",
    "outputs": {method: text}}``.
    """

    rows: list[dict[str, Any]]
    title: str = "scpdr experiment"
    corpus_labels: dict[str, str] = field(default_factory=dict)
    methods: list[str] | None = None
    summary: str = ""
    distributions: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    roc: dict[str, dict[str, dict[str, dict[str, Any]]]] = field(default_factory=dict)
    generations: list[dict[str, Any]] = field(default_factory=list)
    generation_methods: list[str] = field(
        default_factory=lambda: ["none", M.canonical("scp-delta-r")]  # No CP vs SCP-Δr-b
    )
    config_text: str | None = None
    notes: list[str] = field(default_factory=list)
    omitted_reasons: dict[str, str] = field(default_factory=dict)


@dataclass
class RenderedReport:
    markdown: Path
    html: Path
    figures: dict[str, Path | None]
    main: Table
    tables: dict[str, Table]


# -------------------------------------------------------------------------------- blocks


@dataclass
class _Block:
    kind: str  # h1 h2 h3 p note li table figure code
    text: str = ""
    table: Table | None = None
    path: Path | None = None


def _figure_blocks(
    name: str,
    title: str,
    path: Path | None,
    caption: str,
    reason: str,
) -> list[_Block]:
    blocks = [_Block("h3", title)]
    if path is None:
        blocks.append(_Block("note", f"Omitted: {reason}"))
    else:
        blocks.append(_Block("figure", caption, path=path))
    return blocks


def _quantity_panels(
    distributions: Mapping[str, Mapping[str, Mapping[str, Any]]],
    labels: Mapping[str, str],
    quantities: Sequence[tuple[str, str]],
) -> dict[str, dict[str, np.ndarray]]:
    panels: dict[str, dict[str, np.ndarray]] = {}
    multi = len(distributions) > 1
    for corpus, per_q in distributions.items():
        for q, qlabel in quantities:
            d = per_q.get(q)
            if not d:
                continue
            title = qlabel + (f" — {labels.get(corpus, corpus)}" if multi else "")
            panels[title] = {m: np.asarray(v, dtype=np.float64) for m, v in d.items()}
    return panels


def render_report(
    inputs: ReportInputs, out_dir: str | os.PathLike[str], *, draw: bool = True
) -> RenderedReport:
    """Write ``out_dir/report.md``, ``out_dir/report.html`` and ``out_dir/plots/*.png``."""
    out = Path(out_dir)
    plot_dir = out / "plots"
    rows = inputs.rows
    labels = dict(inputs.corpus_labels)
    reasons = dict(inputs.omitted_reasons)

    main = main_table(rows, methods=inputs.methods, corpus_labels=labels, title="Main results")
    tables: dict[str, Table] = {"main": main}
    kx = kx_table(rows, corpus_labels=labels)
    if kx is not None:
        tables["kx"] = kx
    canary = canary_table(rows)
    if canary is not None:
        tables["canary"] = canary
    mia = mia_table(rows, corpus_labels=labels)
    if mia is not None:
        tables["mia"] = mia
    compare = compare_table(rows, corpus_labels=labels)
    if compare is not None:
        tables["compare"] = compare
    budget = budget_table(rows, corpus_labels=labels)
    if budget is not None:
        tables["budget"] = budget
    gens = generations_table(inputs.generations, inputs.generation_methods)
    if gens is not None:
        tables["generations"] = gens

    figures: dict[str, Path | None] = {}

    def draw_or_none(fn: Any, *args: Any, **kwargs: Any) -> Path | None:
        return fn(*args, **kwargs) if draw else None

    figures["kx_hist"] = draw_or_none(
        plots.bound_histograms,
        _quantity_panels(inputs.distributions, labels, [("k_x", "k_x per position")]),
        plot_dir / "kx_hist.png",
        xlabel="k_x (log scale)",
    )
    figures["tx_vx_hist"] = draw_or_none(
        plots.bound_histograms,
        _quantity_panels(
            inputs.distributions,
            labels,
            [
                ("t_x", "t_x, typical tokens"),
                ("t_x_rare", "t_x, rare tokens (canaries)"),
                ("v_x", "v_x(y_s), typical tokens"),
                ("v_x_rare", "v_x(y_s), rare tokens (canaries)"),
            ],
        ),
        plot_dir / "tx_vx_hist.png",
        xlabel="bound (nats, log scale)",
    )
    figures["exposure_vs_m"] = draw_or_none(
        plots.exposure_vs_m, rows, plot_dir / "exposure_vs_m.png"
    )
    figures["tte_vs_epochs"] = draw_or_none(
        plots.tte_vs_epochs, rows, plot_dir / "tte_vs_epochs.png"
    )
    multi = len(inputs.roc) > 1
    for corpus, per_attack in inputs.roc.items():
        name = f"mia_roc_{corpus}"
        ordered = {a: per_attack[a] for a in MIA_LABELS if a in per_attack}
        figures[name] = draw_or_none(
            plots.mia_roc,
            ordered,
            plot_dir / f"{name}.png",
            labels=MIA_LABELS,
            title=labels.get(corpus, corpus) if multi else "",
        )
    if not inputs.roc:
        figures["mia_roc"] = None
    if "budget" in tables:  # an optional section: no "omitted" note without the sweep
        figures["budget"] = draw_or_none(budget_plot, rows, plot_dir / "budget.png")
        figures["frontier"] = draw_or_none(frontier_plot, rows, plot_dir / "frontier.png")

    no_draw = "plots disabled (report.plots: false)."
    default_reasons = {
        "kx_hist": "no k_x distributions in this run (bounds disabled or no NAF methods).",
        "tx_vx_hist": "no t_x / v_x distributions in this run (bounds.t_x / bounds.v_x off, "
        "or no reference model p0).",
        "exposure_vs_m": "no sweep over m with the canary attack in this config (add "
        "`sweeps: [{key: m, values: [1, 10, 100, 1000], attacks: [canary]}]`).",
        "tte_vs_epochs": "no sweep over train.epochs with the TTE attack in this config (see "
        "configs/ablations/epochs.yaml).",
        "mia_roc": "no membership-inference results in this run (attack 'mia' not requested).",
    }

    def reason(name: str) -> str:
        if not draw:
            return no_draw
        base = name if not name.startswith("mia_roc") else "mia_roc"
        return reasons.get(base, default_reasons.get(base, "no data."))

    blocks: list[_Block] = [_Block("h1", inputs.title)]
    if inputs.summary:
        blocks.append(_Block("p", inputs.summary))
    blocks += [_Block("h2", "Main results"), _Block("table", table=main)]
    blocks += [_Block("note", n) for n in main.notes]
    lines = verdicts(rows, methods=inputs.methods)
    if lines:
        blocks += [_Block("h3", "Verdicts")]
        blocks += [_Block("li", line) for line in lines]
    blocks += [_Block("h3", "How to read this table"), _Block("p", READING_GUIDE)]
    sections = {
        "kx": "k_x bounds (99th percentile)",
        "canary": "Canary exposure by repetitions",
        "mia": "Membership inference",
        "compare": "Against the DP baselines",
        "budget": "Extraction budget",
    }
    for key, heading in sections.items():  # the optional tables, each with its notes once
        if key in tables:
            blocks += [_Block("h2", heading), _Block("table", table=tables[key])]
            blocks += [_Block("note", n) for n in tables[key].notes]
    blocks.append(_Block("h2", "Figures"))
    blocks += _figure_blocks(
        "kx_hist",
        "k_x histograms",
        figures["kx_hist"],
        "Per-position NAF bound k_x (Theorems 2.1/2.2) per method, log scale.",
        reason("kx_hist"),
    )
    blocks += _figure_blocks(
        "tx_vx_hist",
        "t_x / v_x histograms",
        figures["tx_vx_hist"],
        "t_x (Theorem 4.1) and v_x(y_s) at the target token (Theorem 4.2, r0 = CP(p0, q)), "
        "log scale.",
        reason("tx_vx_hist"),
    )
    blocks += _figure_blocks(
        "exposure_vs_m",
        "Canary exposure vs m",
        figures["exposure_vs_m"],
        "Exposure of the canaries vs the smoothing parameter m (mean solid, upper percentile "
        "dashed).",
        reason("exposure_vs_m"),
    )
    blocks += _figure_blocks(
        "tte_vs_epochs",
        "TTE AUC vs epochs",
        figures["tte_vs_epochs"],
        "Token-by-token extraction AUC across memorization levels.",
        reason("tte_vs_epochs"),
    )
    roc_names = [n for n in figures if n.startswith("mia_roc")]
    for name in roc_names:
        corpus = name.removeprefix("mia_roc").removeprefix("_")
        title = "Membership-inference ROC" + (f" — {labels.get(corpus, corpus)}" if corpus else "")
        blocks += _figure_blocks(
            name,
            title,
            figures[name],
            "ROC of every membership test per method, log-log axes; the dotted diagonal is chance.",
            reason(name),
        )
    if "budget" in figures:
        blocks += _figure_blocks(
            "budget",
            "Extraction budget",
            figures["budget"],
            "TPR at 1% FPR of LiRA and Ref vs the budget B per response, against the certified "
            "line e^B · 1%; next-token accuracy and tokens per answer vs B (docs/accountant.md).",
            reason("budget"),
        )
    if "frontier" in figures:
        blocks += _figure_blocks(
            "frontier",
            "Privacy–utility frontier",
            figures["frontier"],
            "Every setting (method; budget sweep: serving mode, B or c): x = its strongest "
            "membership test's TPR at 1% FPR, y = next-token accuracy, both with 95% intervals "
            "(docs/accountant.md). "
            + pareto_text(frontier_points(rows))
            + (" Operating points: " + ops if (ops := operating_points_text(rows)) else ""),
            reason("frontier"),
        )
    blocks.append(_Block("h2", "Generations"))
    if "generations" in tables:
        meths = " vs ".join(M.label(m) for m in inputs.generation_methods)
        blocks.append(_Block("p", f"Greedy continuations of training prompts: {meths}."))
        blocks.append(_Block("table", table=tables["generations"]))
    else:
        blocks.append(
            _Block("note", "Omitted: " + reasons.get("generations", "no generations in this run."))
        )
    if inputs.notes:
        blocks.append(_Block("h2", "Notes"))
        blocks += [_Block("p", n) for n in inputs.notes]
    if inputs.config_text:
        blocks += [_Block("h2", "Config"), _Block("code", inputs.config_text)]

    md = _to_markdown(blocks, out)
    page = _to_html(blocks, inputs.title)
    md_path = atomic_write_text(out / "report.md", md)
    html_path = atomic_write_text(out / "report.html", page)
    return RenderedReport(md_path, html_path, figures, main, tables)


def _to_markdown(blocks: Sequence[_Block], root: Path) -> str:
    parts: list[str] = []
    for b in blocks:
        if b.kind == "h1":
            parts.append(f"# {b.text}\n")
        elif b.kind == "h2":
            parts.append(f"## {b.text}\n")
        elif b.kind == "h3":
            parts.append(f"### {b.text}\n")
        elif b.kind == "p":
            parts.append(b.text + "\n")
        elif b.kind == "note":
            parts.append(f"_{b.text}_\n")
        elif b.kind == "li":
            parts.append(f"- {b.text}")
        elif b.kind == "table" and b.table is not None:
            parts.append(to_markdown(b.table))
        elif b.kind == "figure" and b.path is not None:
            rel = os.path.relpath(b.path, root)
            parts.append(f"![{b.text}]({Path(rel).as_posix()})\n\n{b.text}\n")
        elif b.kind == "code":
            parts.append(f"```yaml\n{b.text.rstrip()}\n```\n")
    return "\n".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
table.results{border-collapse:collapse;margin:1em 0;font-size:.9em}
table.results caption{font-weight:600;text-align:left;padding-bottom:.3em}
table.results th,table.results td{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:center}
table.results tbody th{text-align:left;white-space:nowrap}
table.results thead th{background:#f4f4f4}
table.results tr.midrule td,table.results tr.midrule th{border-top:2px solid #555}
p.note{color:#555;font-style:italic;font-size:.9em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.9em}
pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:.85em}
"""


def _to_html(blocks: Sequence[_Block], title: str) -> str:
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
    ]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            parts.append(f"<{b.kind}>{html.escape(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "note":
            parts.append(f"<p class='note'>{html.escape(b.text)}</p>")
        elif b.kind == "li":
            parts.append(f"<ul><li>{_inline(b.text)}</li></ul>")
        elif b.kind == "table" and b.table is not None:
            parts.append(to_html(b.table, notes=False))  # the notes are blocks of their own
        elif b.kind == "figure" and b.path is not None:
            data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
            parts.append(
                f"<figure><img alt='{html.escape(b.text)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{html.escape(b.text)}</figcaption></figure>"
            )
        elif b.kind == "code":
            parts.append(f"<pre><code>{html.escape(b.text)}</code></pre>")
    parts.append("</body></html>\n")
    return "".join(parts)


def _inline(text: str) -> str:
    """Escape, then the two bits of Markdown the report's paragraphs use: **bold**, *italic*."""
    import re

    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    t = re.sub(r"\*(.+?)\*", r"<i>\1</i>", t)
    return t
