"""The privacy–utility frontier (``docs/accountant.md``, "Budgets and attacks"): every setting
with a membership TPR at 1% FPR and a next-token accuracy — a method, a budget sweep point (mode,
B or c), any later sweep's row — one point: x = its strongest membership test's TPR@1% (the
test with the highest TPR@1%) with its 95% interval, y = accuracy with its interval. The Pareto
set (no other point has lower-or-equal TPR and higher-or-equal accuracy, one strictly) is listed
in words under the figure.

Rows are grouped generically: by corpus, method and every ``extra`` key that names a setting
(:data:`SETTING_KEYS`); a membership row is ``metric == "tpr@0.01fpr"`` of an attack of the suite
or ``"<test>_tpr@0.01fpr"`` of the budget sweep, a utility row ``metric == "accuracy"``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.attacks.mia import MIA_ATTACKS, metric_name
from scpdr.io import atomic_write

#: The membership tests' TPR at 1% FPR (the frontier's x).
_TPR = metric_name(0.01)

__all__ = ["SETTING_KEYS", "Point", "frontier_plot", "frontier_points", "pareto", "pareto_text"]

#: ``extra`` keys that tell one setting of a method from another.
SETTING_KEYS: tuple[str, ...] = (
    "mode",
    "budget",
    "anchor",
    "K",
    "m",
    "epsilon",
    "sweep",
    "sweep_value",
)


@dataclass(frozen=True)
class Point:
    """One setting on the frontier: its label, the strongest test and its TPR@1% [interval],
    and accuracy [interval]."""

    label: str
    test: str
    tpr: float
    tpr_low: float
    tpr_high: float
    accuracy: float
    acc_low: float
    acc_high: float


def _num(x: Any, default: float) -> float:
    return default if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _setting(r: Mapping[str, Any]) -> tuple[Any, ...]:
    extra = r.get("extra") or {}
    get = (lambda k: r.get(k, extra.get(k))) if isinstance(extra, Mapping) else r.get
    return (
        r.get("corpus"),
        r["method"],
        r.get("attack") == "budget",
        *(get(k) for k in SETTING_KEYS),
    )


def _label(key: tuple[Any, ...]) -> str:
    corpus, method, swept, *rest = key
    parts = [M.label(method) if method in M.METHOD_ORDER else str(method)]
    vals = dict(zip(SETTING_KEYS, rest, strict=True))
    mode = vals.pop("mode")
    if mode is not None:
        parts.append(str(mode))
    if mode == "anchor":
        parts.append(f"c = {vals.pop('anchor'):g}")
        vals.pop("budget")
    elif swept or vals["budget"] is not None:
        b = vals.pop("budget")
        parts.append("B = ∞" if b is None else f"B = {b:g}")
    sweep, value = vals.pop("sweep"), vals.pop("sweep_value")
    parts += [f"{k} = {v}" for k, v in vals.items() if v is not None]
    if sweep is not None:  # a sweep point: its key and value (e.g. partitions.k = 3)
        parts.append(f"{sweep} = {value}")
    return (f"{corpus} · " if corpus else "") + " · ".join(parts)


def _get(r: Mapping[str, Any], key: str) -> Any:
    extra = r.get("extra") or {}
    return r.get(key, extra.get(key) if isinstance(extra, Mapping) else None)


def frontier_points(rows: Iterable[Mapping[str, Any]]) -> list[Point]:
    """One :class:`Point` per setting with at least one membership TPR@1% and an accuracy
    (flattened rows, :meth:`scpdr.attacks.results.ResultRow.to_dict`, or ``extra`` nested)."""
    tpr: dict[tuple[Any, ...], tuple[float, str, Mapping[str, Any]]] = {}
    acc: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for r in rows:
        metric, attack, value = r.get("metric"), r.get("attack"), r.get("value")
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        key = _setting(r)
        if metric == "accuracy":
            acc[key] = r
            continue
        test = None
        if metric == _TPR and attack in MIA_ATTACKS:
            test = str(attack)
        elif isinstance(metric, str) and metric.endswith(f"_{_TPR}"):
            test = metric[: -len(_TPR) - 1]
        if test is not None and (key not in tpr or float(value) > tpr[key][0]):
            tpr[key] = (float(value), test, r)
    out = []
    for key in sorted(set(tpr) & set(acc), key=str):
        v, test, r = tpr[key]
        a = acc[key]
        y = float(a["value"])
        out.append(
            Point(
                _label(key),
                test,
                v,
                _num(_get(r, "ci_low"), v),
                _num(_get(r, "ci_high"), v),
                y,
                _num(_get(a, "ci_low"), y),
                _num(_get(a, "ci_high"), y),
            )
        )
    return out


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other point dominates (lower-or-equal TPR@1% and higher-or-equal accuracy,
    one of them strictly), by increasing TPR."""

    def dominated(p: Point) -> bool:
        return any(
            q.tpr <= p.tpr
            and q.accuracy >= p.accuracy
            and (q.tpr < p.tpr or q.accuracy > p.accuracy)
            for q in points
        )

    return sorted((p for p in points if not dominated(p)), key=lambda p: (p.tpr, -p.accuracy))


def pareto_text(points: Sequence[Point]) -> str:
    """The Pareto set in words (one sentence)."""
    front = pareto(points)
    if not front:
        return "No setting has both a membership TPR@1% and a next-token accuracy."
    items = [
        f"{p.label} (strongest test {p.test}: TPR@1% {p.tpr:.3g} [{p.tpr_low:.3g}, "
        f"{p.tpr_high:.3g}], accuracy {p.accuracy:.3g})"
        for p in front
    ]
    return "Pareto set (no setting has lower TPR@1% and higher accuracy): " + "; ".join(items) + "."


def frontier_plot(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """The frontier figure (PNG at ``path``): every point with both intervals and its label,
    the Pareto set joined by a line; None when no setting has both numbers."""
    points = frontier_points(rows)
    if not points:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 6.0))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    front = pareto(points)
    for p in points:
        on = p in front
        ax.errorbar(
            p.tpr, p.accuracy,
            xerr=[[max(p.tpr - p.tpr_low, 0)], [max(p.tpr_high - p.tpr, 0)]],
            yerr=[[max(p.accuracy - p.acc_low, 0)], [max(p.acc_high - p.accuracy, 0)]],
            fmt="o", ms=4, capsize=2, color="tab:red" if on else "tab:blue", alpha=0.8,
        )  # fmt: skip
        ax.annotate(p.label, (p.tpr, p.accuracy), fontsize=5, xytext=(3, 3),
                    textcoords="offset points")  # fmt: skip
    ax.plot([p.tpr for p in front], [p.accuracy for p in front], color="tab:red", lw=0.8)
    ax.axvline(0.01, color="grey", lw=0.8, ls=":", label="chance (TPR = FPR = 1%)")
    ax.set_xlabel("strongest membership test: TPR at 1% FPR (95% CI)")
    ax.set_ylabel("next-token accuracy (95% CI)")
    ax.set_title("Privacy–utility frontier (red: Pareto set)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write(path, lambda q: fig.savefig(q, format="png", dpi=110))
