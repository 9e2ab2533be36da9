"""The report's figures (matplotlib, no pyplot global state: ``Figure`` + the Agg canvas).

Every function writes one PNG atomically and returns its path, or returns ``None`` when it has no
data (the report then says the plot was omitted — nothing is faked):

- :func:`bound_histograms` — log-scale histograms of per-position bounds per method: k_x (paper
  Fig. 2b), t_x (Fig. "t_x bounds", Thm 4.1) and v_x(y_s) (Fig. 3, Thm 4.2), one panel each.
- :func:`exposure_vs_m` — canary exposure vs the smoothing parameter m, log x (Fig. 4a; mean
  solid, upper percentile dashed).
- :func:`tte_vs_epochs` — TTE AUC vs training epochs (Fig. 4b).
- :func:`lira_roc` — ROC curves of one membership test on log-log axes (Carlini et al. 2022
  style), and :func:`mia_roc` — one such panel per attack of the MIA suite.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scpdr import methods as M
from scpdr.io import atomic_write

__all__ = [
    "bound_histograms",
    "exposure_vs_m",
    "lira_roc",
    "method_color",
    "mia_roc",
    "tte_vs_epochs",
]


def method_color(method: str) -> str:
    """The plot colour of a result row (:attr:`scpdr.methods.MethodSpec.color`; grey for rows
    not in the registry)."""
    spec = M.SPECS.get(M.canonical(method))
    return spec.color if spec is not None else "#7f7f7f"


def _label(method: str) -> str:
    return M.label(method)


def _sorted_methods(methods: Iterable[str]) -> list[str]:
    methods = list(dict.fromkeys(methods))
    rank = {m: i for i, m in enumerate(M.METHOD_ORDER)}
    return sorted(methods, key=lambda m: (rank.get(m, len(rank)), m))


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    return atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))


def _figure(ncols: int = 1, *, width: float = 5.0, height: float = 3.6) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height))
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def bound_histograms(
    panels: Mapping[str, Mapping[str, Sequence[float] | np.ndarray]],
    path: str | os.PathLike[str],
    *,
    xlabel: str,
    floor: float = 1e-6,
    bins: int = 40,
) -> Path | None:
    """One panel per entry of ``panels`` (title → {method: per-position values}); histograms of
    the values on a log x axis (values below ``floor``, including 0, are drawn at ``floor``)."""
    panels = {
        t: {m: np.asarray(v, dtype=np.float64).ravel() for m, v in d.items() if len(v)}
        for t, d in panels.items()
    }
    panels = {t: d for t, d in panels.items() if d}
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (title, dists) in zip(axes, panels.items(), strict=True):
        finite = np.concatenate([v[np.isfinite(v)] for v in dists.values()])
        if finite.size == 0:
            ax.set_title(f"{title} (no finite values)")
            continue
        lo = max(float(np.min(np.clip(finite, floor, None))), floor)
        hi = max(float(np.max(finite)), lo * 10)
        edges = np.logspace(math.log10(lo), math.log10(hi), bins + 1)
        for method in _sorted_methods(dists):
            v = dists[method]
            v = np.clip(v[np.isfinite(v)], floor, None)
            ax.hist(
                v,
                bins=edges,
                histtype="step",
                linewidth=1.6,
                color=method_color(method),
                label=f"{_label(method)} (p99 {np.percentile(v, 99):.3g})"
                if v.size
                else _label(method),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("positions")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _sweep_rows(
    rows: Iterable[Mapping[str, Any]], key: str, attack: str
) -> list[Mapping[str, Any]]:
    return [
        r
        for r in rows
        if r.get("sweep") == key and r.get("attack") == attack and r.get("value") is not None
    ]


def _line_series(
    rows: Sequence[Mapping[str, Any]], metric: str
) -> dict[str, tuple[list[float], list[float]]]:
    series: dict[str, dict[float, float]] = {}
    for r in rows:
        if r.get("metric") != metric:
            continue
        x = r.get("sweep_value")
        if x is None:
            continue
        series.setdefault(r["method"], {})[float(x)] = float(r["value"])
    return {m: (sorted(d), [d[x] for x in sorted(d)]) for m, d in series.items()}


def exposure_vs_m(
    rows: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    key: str = "m",
) -> Path | None:
    """Canary exposure vs m from the rows of a sweep over ``key`` (rows tagged
    ``sweep == key``, ``sweep_value``): mean solid, 95th/99th percentile dashed, log x axis."""
    rows = _sweep_rows(rows, key, "canary")
    # Pooled rows (no repetitions field) or, failing that, repetitions == 3 (paper's setting).
    pooled = [r for r in rows if r.get("repetitions") is None]
    if not pooled:
        reps = sorted({r.get("repetitions") for r in rows if r.get("repetitions") is not None})
        pick = 3 if 3 in reps else (reps[-1] if reps else None)
        pooled = [r for r in rows if r.get("repetitions") == pick]
    means = {}
    for metric in ("mean", "exposure_mean"):
        means = _line_series(pooled, metric)
        if means:
            break
    if not means:
        return None
    upper: dict[str, tuple[list[float], list[float]]] = {}
    upper_label = ""
    for metric, lab in (
        ("p99", "99%"),
        ("exposure_p99", "99%"),
        ("p95", "95%"),
        ("exposure_p95", "95%"),
    ):
        upper = _line_series(pooled, metric)
        if upper:
            upper_label = lab
            break
    fig, (ax,) = _figure(1)
    for method in _sorted_methods(means):
        xs, ys = means[method]
        ax.plot(xs, ys, "-o", color=method_color(method), label=f"{_label(method)} mean")
        if method in upper:
            ux, uy = upper[method]
            ax.plot(
                ux, uy, "--", color=method_color(method), label=f"{_label(method)} {upper_label}"
            )
    ax.set_xscale("log")
    ax.set_xlabel("smoothing parameter m")
    ax.set_ylabel("canary exposure (bits)")
    ax.set_title("Canary exposure vs m")
    ax.legend(fontsize=7)
    return _save(fig, path)


def tte_vs_epochs(
    rows: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    key: str = "train.epochs",
    metric: str = "auc",
) -> Path | None:
    """TTE AUC vs the number of training epochs (rows of a sweep over ``key``), one panel per
    corpus."""
    rows = _sweep_rows(rows, key, "tte")
    corpora = list(dict.fromkeys(r.get("corpus") for r in rows))
    panels = {c: _line_series([r for r in rows if r.get("corpus") == c], metric) for c in corpora}
    panels = {c: s for c, s in panels.items() if s}
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (corpus, series) in zip(axes, panels.items(), strict=True):
        for method in _sorted_methods(series):
            xs, ys = series[method]
            ax.plot(xs, ys, "-o", color=method_color(method), label=_label(method))
        ax.set_xlabel("training epochs")
        ax.set_ylabel(f"TTE {metric.upper()}")
        ax.set_title(f"TTE {metric.upper()} vs epochs" + (f" ({corpus})" if corpus else ""))
        ax.legend(fontsize=7)
    return _save(fig, path)


def _roc_panel(ax: Any, curves: Mapping[str, Mapping[str, Any]], title: str) -> None:
    """ROC curves of one test, one per method, on log-log axes with the chance diagonal."""
    lo = 1.0
    for method in _sorted_methods(curves):
        c = curves[method]
        fpr = np.asarray(c["fpr"], dtype=np.float64)
        tpr = np.asarray(c["tpr"], dtype=np.float64)
        pos = fpr[fpr > 0]
        if pos.size:
            lo = min(lo, float(pos.min()))
        auc = c.get("auc")
        lab = _label(method) + (f" (AUC {float(auc):.2f})" if auc is not None else "")
        ax.plot(np.clip(fpr, 1e-4, 1), np.clip(tpr, 1e-4, 1), color=method_color(method), label=lab)
    lo = max(min(lo, 0.01), 1e-4)
    ax.plot([lo, 1], [lo, 1], ":", color="#888888", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1)
    ax.set_ylim(lo, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.legend(fontsize=6, loc="lower right")


def _usable(curves: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {m: c for m, c in curves.items() if len(c.get("fpr", ())) > 1}


def lira_roc(
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    path: str | os.PathLike[str],
    *,
    title: str = "LiRA ROC",
) -> Path | None:
    """ROC curves (``{method: {"fpr": [...], "tpr": [...], "auc": float?}}``) on log-log axes with
    the chance diagonal."""
    curves = _usable(curves)
    if not curves:
        return None
    fig, (ax,) = _figure(1, width=4.6, height=4.2)
    _roc_panel(ax, curves, title)
    return _save(fig, path)


def mia_roc(
    per_attack: Mapping[str, Mapping[str, Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    labels: Mapping[str, str] | None = None,
    title: str = "",
) -> Path | None:
    """One log-log ROC panel per attack (``{attack: {method: curve}}``, in the given order), each
    with the chance diagonal; ``labels`` names the attacks."""
    panels = {a: _usable(c) for a, c in per_attack.items()}
    panels = {a: c for a, c in panels.items() if c}
    if not panels:
        return None
    from matplotlib.figure import Figure

    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(4.4 * ncols, 4.0 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (attack, curves) in zip(axes, panels.items(), strict=False):
        name = (labels or {}).get(attack, attack)
        _roc_panel(ax, curves, f"{title} — {name}" if title else name)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return _save(fig, path)
