"""Bound distributions on real prompts (§4.1 Fig. 2b, App. D.2 table "k_x (99%)", §4.2 Fig. 3,
App. D.3 Fig. "t_x bounds").

One teacher-forced pass of a ``ProtectedLM`` with ``score(..., components=True)`` gives the raw
constituent (and base) log-probs at every position; every bound of every method is then pure math
(:mod:`scpdr.bounds`) on them, so one pass serves all methods:

- ``k_x``: the NAF bound of the method at each position (Def. 2.1; Thm. 2.3 for CP-Δ, Thm. 2.7
  for CP-Δr, on the smoothed distributions for SCP-Δr, §4.1);
- ``t_x``: the LiRA bound for ``r_0 = q`` (Thm. 4.4), max over the constituents playing q;
- ``v_x(y_s)``: the LiRA bound for ``r_0 = CP(p_0, q)`` (Thm. 4.5; Remark 4.7 for CP-Δ) at the
  target token ``y_s`` (the true next token), with ``p_1`` = constituent 0 (trained on the
  targets), ``q`` = constituent 1 and ``p_0`` from a reference scorer (constituent 0 of
  ``ref_scorer``: a model trained on a subset without the targets).

Methods are the result-row names of :data:`scpdr.methods.BOUND_METHODS`: every stateless rule,
SCP-Δr-b (base = the base model, from the components) and SCP-Δr-c (base = the bundle's constant
vector, passed as ``base_vector``); No CP ("none") gives ``max_i Δ(p_0||p_i)``.
Rare tokens are the secret part of canaries; typical tokens are every position of training text
(the report's quantities ``k_x``, ``t_x``, ``v_x`` and ``*_rare``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from scpdr import methods as M
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import (
    Scorer,
    _field,
    _length_batches,
    encode,
    pad_batch,
    pad_token_id,
    scorer_name,
    split_components,
)
from scpdr.errors import ConfigError

__all__ = [
    "BOUND_METHODS",
    "BoundDistributions",
    "bound_distributions",
    "plot_bound_histograms",
    "split_bound_method",
]

log = logging.getLogger(__name__)

#: Result-row methods with per-position bounds (:data:`scpdr.methods.BOUND_METHODS`; aliases such
#: as "scp-delta-r" resolve to their row).
BOUND_METHODS: tuple[str, ...] = M.BOUND_METHODS
QUANTITIES = ("k_x", "t_x", "v_x")


def split_bound_method(name: str) -> tuple[str, str | None]:
    """``(rule, base)`` of a result-row method with bounds: its ``scpdr.naf`` rule and the base
    its smoothing uses ("model", "constant" or None). Raises
    :class:`~scpdr.methods.UnknownMethodError` (a ``ConfigError``) naming the methods with
    bounds (CP-Fuse is stateful and has no per-position NAF bound of its own)."""
    spec = M.resolve(name, allowed=M.BOUND_METHODS, what="bound method")
    return spec.rule, spec.base


@dataclass
class BoundDistributions:
    """``values[quantity][method]``: per-position values (``float64[N]``) of ``k_x``, ``t_x``,
    ``v_x`` (nats), pooled over the given sequences' scored positions."""

    values: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    n_positions: int = 0

    def add(self, quantity: str, method: str, vals: Tensor) -> None:
        arr = vals.detach().double().cpu().numpy().ravel()
        per = self.values.setdefault(quantity, {})
        per[method] = np.concatenate([per[method], arr]) if method in per else arr

    def summary(self, quantity: str, method: str) -> dict[str, float]:
        v = self.values[quantity][method]
        v = v[np.isfinite(v)]
        if v.size == 0:
            return {
                "mean": float("nan"),
                "p50": float("nan"),
                "p99": float("nan"),
                "max": float("nan"),
            }
        return {
            "mean": float(v.mean()),
            "p50": float(np.percentile(v, 50)),
            "p99": float(np.percentile(v, 99)),
            "max": float(v.max()),
        }

    def rows(self, *, corpus: str | None = None, rare: bool = False) -> list[ResultRow]:
        """Rows ``attack="bounds"``, metric ``"<q>[_rare]_<stat>"`` (``k_x_p99`` is the report's
        k_x table)."""
        out = []
        suffix = "_rare" if rare else ""
        for q, per in self.values.items():
            for method, v in per.items():
                n = int(np.isfinite(v).sum())
                std = float(np.std(v[np.isfinite(v)], ddof=1)) if n > 1 else None
                for stat, val in self.summary(q, method).items():
                    out.append(
                        ResultRow(
                            method,
                            "bounds",
                            f"{q}{suffix}_{stat}",
                            val,
                            n,
                            std if stat == "mean" else None,
                            corpus,
                            {"tokens": "rare" if rare else "typical"},
                        )
                    )
        return out

    def as_report_distributions(self, *, rare: bool = False) -> dict[str, dict[str, list[float]]]:
        """``{quantity[_rare]: {method: values}}`` — ``scpdr.report.ReportInputs.distributions``
        for one corpus."""
        suffix = "_rare" if rare else ""
        return {
            q + suffix: {m: v.tolist() for m, v in per.items()} for q, per in self.values.items()
        }


def _as_ids(tokenizer: object, xs: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    return [encode(tokenizer, x) if isinstance(x, str) else list(x) for x in xs]


def bound_distributions(
    scorer: Scorer,
    sequences: Sequence[str] | Sequence[Sequence[int]],
    *,
    methods: Sequence[str],
    m: int = 10,
    quantities: Sequence[str] = QUANTITIES,
    ref_scorer: Scorer | None = None,
    base_vector: Tensor | None = None,
    start: Sequence[int] | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4,
    chunk_positions: int = 256,
) -> BoundDistributions:
    """Per-position ``k_x`` / ``t_x`` / ``v_x(y_s)`` of every method in ``methods`` on
    ``sequences`` (texts or token-ID lists).

    ``scorer`` must expose ``score(..., components=True)`` (a ``ProtectedLM``; an SCP "-b" method
    needs one that runs the base model, i.e. ``method="scp-delta-r"`` with ``base="model"``).
    ``start[i]``: the first position of sequence ``i`` whose *target token* index is counted
    (e.g. the first secret token of a canary); default 1 (every predicted token).
    ``v_x`` needs ``ref_scorer`` (its constituent 0 is ``p_0``) and is computed for the methods
    with a v_x theorem (CP-Δ, CP-Δr, SCP-Δr); it is skipped with a log line otherwise.
    """
    from scpdr import bounds

    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown:
        raise ConfigError(f"unknown bound quantities {unknown}; known: {list(QUANTITIES)}")
    specs = {M.canonical(name): split_bound_method(name) for name in methods}  # row name: rule
    want_v = "v_x" in quantities
    if want_v and ref_scorer is None:
        log.info("bounds: no reference scorer (p0): v_x skipped")
        want_v = False
    tok = scorer.tokenizer
    seqs = _as_ids(tok, sequences)
    if max_tokens is not None:
        seqs = [s[:max_tokens] for s in seqs]
    starts = [1] * len(seqs) if start is None else [max(1, int(s)) for s in start]
    if len(starts) != len(seqs):
        raise ValueError("start must give one position per sequence")
    out = BoundDistributions()
    pid = pad_token_id(tok)
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        logps, base = split_components(
            _field(scorer.score(ids, mask, components=True), "components")
        )
        p0 = None
        if want_v:
            ref_comp = _field(ref_scorer.score(ids, mask, components=True), "components")
            p0 = split_components(ref_comp)[0][0]  # (B, T-1, V)
        # positions to keep: real target token with index >= start
        tgt_pos = torch.arange(1, ids.shape[1]).expand(len(idx), -1)  # (B, T-1)
        keep = (mask[:, 1:] == 1) & (mask[:, :-1] == 1)
        keep &= tgt_pos >= torch.tensor([starts[i] for i in idx]).unsqueeze(1)
        if not keep.any():
            continue
        lp = logps[:, keep].float()  # (K, N, V)
        b_model = base[keep].float() if isinstance(base, Tensor) and base.ndim == 3 else None
        y = ids[:, 1:][keep]  # (N,)
        p0k = p0[keep].float() if p0 is not None else None
        for s in range(0, lp.shape[1], chunk_positions):
            sl = slice(s, s + chunk_positions)
            for name, (method, src) in specs.items():
                if src == "model":
                    if b_model is None:
                        raise ConfigError(
                            f"method {name!r} needs the base model's log-probs, but "
                            f"{scorer_name(scorer)}'s components carry none: score with a "
                            "ProtectedLM of method 'scp-delta-r' and base='model'"
                        )
                    b = b_model[sl]
                elif src == "constant":
                    b = base_vector if base_vector is not None else base
                    if not isinstance(b, Tensor) or b.ndim != 1:
                        raise ConfigError(
                            f"method {name!r} needs the constant base vector: pass base_vector="
                            "(scpdr.models.load_constant_base) or score with a '-c' ProtectedLM"
                        )
                    b = b.float()
                else:
                    b = None
                if "k_x" in quantities:
                    out.add("k_x", name, bounds.k_x(method, lp[:, sl], base=b, m=m))
                if "t_x" in quantities:
                    out.add("t_x", name, bounds.t_x(method, lp[:, sl], base=b, m=m))
                if want_v and M.SPECS[name].has_v_x:
                    v = bounds.v_x(method, lp[:2, sl], p0k[sl], y[sl], base=b, m=m)
                    out.add("v_x", name, v)
        out.n_positions += int(keep.sum())
        log.debug("bounds: %d positions so far", out.n_positions)
    return out


def plot_bound_histograms(
    dists: Mapping[str, BoundDistributions] | BoundDistributions,
    path: str | os.PathLike[str],
    *,
    quantities: Sequence[str] = QUANTITIES,
    bins: int = 40,
) -> Path | None:
    """Log-scale histograms, one panel per (label, quantity), one step curve per method (the
    paper's Fig. 2b / Fig. 3 style). ``dists``: ``{label: BoundDistributions}`` (e.g.
    ``{"typical": ..., "rare": ...}``). Returns None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from scpdr.io import atomic_write

    if isinstance(dists, BoundDistributions):
        dists = {"": dists}
    labels = [lab for lab, d in dists.items() if any(d.values.get(q) for q in quantities)]
    qs = [q for q in quantities if any(dists[lab].values.get(q) for lab in labels)]
    if not labels or not qs:
        return None
    # one row per label (typical, rare), one column per quantity
    fig, axes = plt.subplots(
        len(labels), len(qs), figsize=(4.2 * len(qs), 3.2 * len(labels)), squeeze=False
    )
    for i, label in enumerate(labels):
        for j, q in enumerate(qs):
            ax = axes[i][j]
            per = dists[label].values.get(q) or {}
            pos = [v[np.isfinite(v) & (v > 0)] for v in per.values()]
            allv = np.concatenate(pos) if pos else np.zeros(0)
            if allv.size == 0:
                ax.set_title(f"{q} {label}: no positive values")
                ax.axis("off")
                continue
            lo, hi = max(allv.min(), 1e-8), max(allv.max(), 1e-7)
            edges = np.logspace(np.log10(lo), np.log10(hi * 1.0001), bins)
            for method, v in per.items():
                v = v[np.isfinite(v) & (v > 0)]
                if v.size:
                    p99 = np.percentile(v, 99)
                    ax.hist(v, bins=edges, histtype="step", label=f"{method} (p99 {p99:.3g})")
            ax.set(
                xscale="log",
                yscale="log",
                xlabel=f"{q} (nats)",
                ylabel="positions",
                title=f"{q} {label}".strip(),
            )
            ax.legend(fontsize=6)
    fig.tight_layout()
    out = atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=130))
    plt.close(fig)
    return out
