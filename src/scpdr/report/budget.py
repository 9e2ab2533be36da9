"""The budget sweep in the report (``docs/accountant.md``, "Budgets and attacks"): a table of every
method at every budget B (PII AEL/FER, ``ref``/``lira`` TPR at 1% FPR with 95% intervals,
next-token accuracy, tokens per answer) and one figure: TPR@1% vs B with the certified line
``TPR <= e^B · FPR`` (at FPR = 1%), and utility vs B.

Rows: ``attack == "budget"`` from :func:`scpdr.attacks.budget.budget_rows` (``budget`` None: no
budget, shown as ∞).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.io import atomic_write
from scpdr.report.cells import Cell, Column, Table, format_value
from scpdr.report.plots import method_color

__all__ = ["BUDGET_COLUMNS", "FPR", "budget_plot", "budget_table", "certified_tpr"]

#: The false-positive rate of the table and the figure (the suite's ``tpr@0.01fpr``).
FPR = 0.01
_TPR = "tpr@0.01fpr"
#: (header, metric, direction): the table's columns.
BUDGET_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("PII AEL", "pii_ael", "down"),
    ("PII FER", "pii_fer", "down"),
    ("ref TPR@1%", f"ref_{_TPR}", "down"),
    ("LiRA TPR@1%", f"lira_{_TPR}", "down"),
    ("accuracy", "accuracy", "up"),
    ("tokens / answer", "tokens_per_answer", "up"),
    ("private tokens", "private_fraction", "up"),
)


def certified_tpr(budget: float | None, fpr: float = FPR) -> float:
    """The certified line: ``min(1, e^B · fpr)`` (1 without a budget)."""
    if budget is None or math.isinf(budget) or budget * 1.0 > 700:
        return 1.0
    return min(1.0, math.exp(budget) * fpr)


def _bound(r: Mapping[str, Any], key: str, value: float) -> float:
    """An interval end, or ``value`` itself when the row has none."""
    x = r.get(key)
    return value if x is None or math.isnan(float(x)) else float(x)


def _rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r.get("attack") == "budget" and not r.get("sweep")]


def _key(b: Any) -> float:
    return math.inf if b is None else float(b)


def _grid(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str], list[Any]]:
    corpora = sorted({str(r.get("corpus") or "") for r in rows})
    rank = {m: i for i, m in enumerate(M.METHOD_ORDER)}
    methods = sorted({str(r["method"]) for r in rows}, key=lambda m: (rank.get(m, 99), m))
    budgets = sorted({r.get("budget") for r in rows}, key=_key)
    return corpora, methods, budgets


def _find(rows: Sequence[Mapping[str, Any]], **want: Any) -> Mapping[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _text(r: Mapping[str, Any] | None) -> str:
    if r is None or r.get("value") is None:
        return "–"
    lo, hi = r.get("ci_low"), r.get("ci_high")
    text = format_value(float(r["value"]))
    if lo is not None and hi is not None and not (math.isnan(lo) or math.isnan(hi)):
        text += f" [{format_value(float(lo))}, {format_value(float(hi))}]"
    return text


def budget_table(
    rows: Iterable[Mapping[str, Any]], *, corpus_labels: Mapping[str, str] | None = None
) -> Table | None:
    """One row per corpus × method × budget, the columns of :data:`BUDGET_COLUMNS` (value
    [95% interval]); None without budget rows."""
    rows = _rows(rows)
    if not rows:
        return None
    corpora, methods, budgets = _grid(rows)
    labels = dict(corpus_labels or {})
    columns = [Column(h, "", "", d, "budget", (m,), None) for h, m, d in BUDGET_COLUMNS]
    columns.insert(0, Column("certified TPR@1%", "", "", "down", None, (), None))
    row_labels, row_keys, cells = [], [], []
    # the serving mode (stop, fallback, anchor at c; rows without one: the stop rule)
    kinds = sorted(
        {(r.get("mode"), r.get("anchor")) for r in rows},
        key=lambda k: (("stop", "fallback", "anchor", None).index(k[0]) if k[0] in
                       ("stop", "fallback", "anchor", None) else 9, _key(k[1])),
    )  # fmt: skip
    for c in corpora:
        for m in methods:
            for mode, anchor in kinds:
                for b in budgets if mode != "anchor" else [None]:
                    want = {"corpus": c or None, "method": m, "budget": b, "mode": mode}
                    if mode == "anchor":
                        want["anchor"] = anchor
                    if _find(rows, **want) is None:
                        continue
                    where = f"{labels.get(c, c)} · " if len(corpora) > 1 else ""
                    setting = (
                        f"anchor c = {anchor:g}" if mode == "anchor"
                        else f"{mode + ' · ' if mode else ''}B = {'∞' if b is None else f'{b:g}'}"
                    )  # fmt: skip
                    row_labels.append(f"{where}{M.label(m)} · {setting}")
                    row_keys.append(
                        f"{c}/{m}/{b}" if mode is None else f"{c}/{m}/{mode}/{anchor}/{b}"
                    )
                    line = certified_tpr(b) if mode != "anchor" else 1.0
                    row = [Cell(line, format_value(line))]
                    for _, metric, _ in BUDGET_COLUMNS:
                        r = _find(rows, **want, metric=metric)
                        row.append(Cell(None if r is None else r.get("value"), _text(r)))
                    cells.append(row)
    notes = [
        "Each example is one response held to B nats (docs/accountant.md): the attacker sees only "
        "the positions served before the budget stops it. B = ∞: no budget.",
        "Certified: TPR <= e^B · FPR at FPR = 1% (Proposition 1 and Corollary 2 under the "
        "paper's LiRA model with the reference the constituent that never saw the example). "
        "Intervals: 95% bootstrap. Accuracy counts a withheld position as not predicted.",
    ]
    return Table("Extraction budget sweep", columns, row_labels, row_keys, cells, notes=notes)


def budget_plot(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """TPR@1% (LiRA solid, ref dashed, with intervals) vs B against the certified line, and
    utility (accuracy, tokens per answer) vs B; ∞ is drawn right of the largest budget. None
    without budget rows."""
    rows = _rows(rows)
    if not rows:
        return None
    _, methods, budgets = _grid(rows)
    finite = [float(b) for b in budgets if b is not None]
    top = max(finite) if finite else 1.0
    inf_x = top * 2.5

    def x_of(b: Any) -> float:
        return inf_x if b is None else max(float(b), 1e-2)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.2, 3.6))
    FigureCanvasAgg(fig)
    ax_tpr, ax_acc, ax_tok = fig.subplots(1, 3)
    xs = sorted({x_of(b) for b in budgets})
    low = min(finite) / 2 if finite else 0.5
    fine = [low * (inf_x / low) ** (i / 200) for i in range(201)]  # up to ∞'s position
    ax_tpr.plot(fine, [certified_tpr(v) for v in fine], color="black", lw=1.2, label="e^B · 1%")
    for m in methods:
        color = method_color(m)
        for attack, style in (("lira", "-"), ("ref", "--")):
            pts = [
                (x_of(r.get("budget")), r)
                for r in rows
                if r["method"] == m
                and r["metric"] == f"{attack}_{_TPR}"
                and r.get("value") is not None
            ]
            if not pts:
                continue
            pts.sort(key=lambda p: p[0])
            ys = [float(r["value"]) for _, r in pts]
            lo = [y - _bound(r, "ci_low", y) for y, (_, r) in zip(ys, pts, strict=True)]
            hi = [_bound(r, "ci_high", y) - y for y, (_, r) in zip(ys, pts, strict=True)]
            ax_tpr.errorbar(
                [p[0] for p in pts], ys, yerr=[lo, hi], fmt=style, marker="o", ms=3,
                color=color, capsize=2, label=f"{M.label(m)} {attack}",
            )  # fmt: skip
        for ax, metric in ((ax_acc, "accuracy"), (ax_tok, "tokens_per_answer")):
            pts = sorted(
                (x_of(r.get("budget")), float(r["value"]))
                for r in rows
                if r["method"] == m and r["metric"] == metric and r.get("value") is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, color=color, label=M.label(m))
    ax_tpr.axhline(FPR, color="grey", lw=0.8, ls=":", label="chance (FPR)")
    titles = (
        (ax_tpr, "TPR at 1% FPR"),
        (ax_acc, "next-token accuracy"),
        (ax_tok, "tokens per greedy answer"),
    )
    for ax, title in titles:
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels(["∞" if x == inf_x else f"{x:g}" for x in xs])
        ax.set_xlabel("budget B (nats per example)")
        ax.set_title(title)
        ax.legend(fontsize=6)
    ax_tpr.set_ylim(-0.02, 1.02)
    fig.tight_layout()
    return atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))
