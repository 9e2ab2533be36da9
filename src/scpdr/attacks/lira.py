"""LiRA membership inference (§4.2 "Likelihood ratio attack", Theorems 4.4/4.5, App. C.1).

The paper's bounds (``t_x``, ``v_x``) bound the likelihood ratio ``r1(y|x) / r0(y|x)`` of the
target against a reference model trained without the targets; LiRA thresholds that ratio, which
is the optimal membership test under the assumptions of App. C.1 (Sablayrolles et al. 2019).
Here it is run offline with one reference scorer: per example the statistic is the mean (or
sum) over its tokens of ``log r1(x_t|x_<t) - log r0(x_t|x_<t)`` — with one reference model and a
global variance, Carlini et al.'s offline LiRA is a monotone function of this difference, so the
ROC is the same. Members are target training examples; non-members are held out.

Reported: ROC AUC and TPR at 1% and 0.1% FPR (the largest TPR whose FPR is at most the level;
with fewer than ``1/level`` non-members only FPR = 0 qualifies, so ``n_nonmembers`` is reported
too), and :func:`plot_roc` draws the log-scale ROC (matplotlib, Agg backend).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, batched_token_logprobs, encode, scorer_name
from scpdr.errors import ConfigError

__all__ = [
    "LiRAResult",
    "lira",
    "plot_roc",
    "roc_auc",
    "roc_curve",
    "tpr_at_fpr",
]

FPR_LEVELS = (0.01, 0.001)


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(fpr, tpr)`` from ``(0, 0)`` to ``(1, 1)`` over every distinct threshold (higher score =
    predicted member; ``labels`` 1 = member). Tied scores move together (a diagonal step)."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).astype(bool).ravel()
    if s.shape != y.shape:
        raise ValueError("scores and labels must have the same length")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ConfigError("a ROC curve needs both members and non-members")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last_of_tie = np.r_[s[1:] != s[:-1], True]
    tp = np.cumsum(y)[last_of_tie]
    fp = np.cumsum(~y)[last_of_tie]
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (trapezoids; ties count 1/2: the Mann–Whitney statistic)."""
    fpr, tpr = roc_curve(scores, labels)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, level: float) -> float:
    """The largest TPR among ROC points with ``FPR <= level``."""
    ok = np.asarray(fpr) <= level + 1e-12
    return float(np.max(np.asarray(tpr)[ok])) if ok.any() else 0.0


@dataclass
class LiRAResult:
    """Per example: the log-likelihood-ratio statistic (``float[N]``) and membership
    (``bool[N]``)."""

    scores: np.ndarray
    members: np.ndarray
    method: str = "scorer"
    reference: str = "reference"

    def roc(self) -> tuple[np.ndarray, np.ndarray]:
        return roc_curve(self.scores, self.members)

    @property
    def auc(self) -> float:
        return roc_auc(self.scores, self.members)

    def tpr_at(self, level: float) -> float:
        return tpr_at_fpr(*self.roc(), level)

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        method = method or self.method
        n = int(self.scores.size)
        extra = {
            "n_members": int(self.members.sum()),
            "n_nonmembers": int((~self.members).sum()),
            "reference": self.reference,
        }
        out = [ResultRow(method, "lira", "auc", self.auc, n, None, corpus, extra)]
        for level in FPR_LEVELS:
            out.append(
                ResultRow(
                    method, "lira", f"tpr@{level:g}fpr", self.tpr_at(level), n, None, corpus, extra
                )
            )
        return out


def _seq_stats(
    target: Scorer,
    reference: Scorer,
    seqs: list[list[int]],
    *,
    statistic: str,
    batch_size: int,
    cache: dict | None,
) -> np.ndarray:
    t = batched_token_logprobs(target, seqs, batch_size=batch_size)
    key = (id(reference), hash(tuple(map(tuple, seqs))))
    if cache is not None and key in cache:
        r = cache[key]
    else:
        r = batched_token_logprobs(reference, seqs, batch_size=batch_size)
        if cache is not None:
            cache[key] = r
    out = np.empty(len(seqs))
    for i, (a, b) in enumerate(zip(t, r, strict=True)):
        d = (a - b).double().numpy()
        if d.size == 0:
            raise ConfigError(f"example {i} has fewer than 2 tokens: nothing to score")
        out[i] = d.sum() if statistic == "sum" else d.mean()
    return out


def lira(
    target: Scorer,
    reference: Scorer,
    members: Sequence[str] | Sequence[Sequence[int]],
    nonmembers: Sequence[str] | Sequence[Sequence[int]],
    *,
    statistic: str = "mean",
    max_tokens: int | None = None,
    batch_size: int = 16,
    cache: dict | None = None,
) -> LiRAResult:
    """Offline LiRA of ``target`` against ``reference`` (trained without the members; for a NAF
    method the worst case is ``CP(p0, q)`` with ``p0`` trained without them, Theorem 4.5).
    ``statistic``: ``"mean"`` (per-token average log-ratio) or ``"sum"``. ``cache``: a dict kept
    across calls that share a reference scorer object (e.g. ``q`` for every method), so its
    scores are computed once."""
    if statistic not in ("mean", "sum"):
        raise ConfigError(f"statistic must be 'mean' or 'sum', got {statistic!r}")
    if not members or not nonmembers:
        raise ConfigError("LiRA needs at least one member and one non-member example")
    tok = target.tokenizer

    def ids(xs: Sequence) -> list[list[int]]:
        out = [encode(tok, x) if isinstance(x, str) else list(x) for x in xs]
        return [s[:max_tokens] for s in out] if max_tokens is not None else out

    seqs = ids(members) + ids(nonmembers)
    scores = _seq_stats(
        target, reference, seqs, statistic=statistic, batch_size=batch_size, cache=cache
    )
    labels = np.r_[np.ones(len(members), dtype=bool), np.zeros(len(nonmembers), dtype=bool)]
    return LiRAResult(scores, labels, scorer_name(target), scorer_name(reference, "reference"))


def plot_roc(results: Mapping[str, LiRAResult], path: str | os.PathLike[str]) -> Path:
    """Log-log ROC curves, one per method, with the chance diagonal; written atomically."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from scpdr.io import atomic_write

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    floor = 1e-4
    for name, res in results.items():
        fpr, tpr = res.roc()
        ax.step(
            np.maximum(fpr, floor),
            np.maximum(tpr, floor),
            where="post",
            label=f"{name} (AUC {res.auc:.3f})",
        )
    grid = np.logspace(-4, 0, 50)
    ax.plot(grid, grid, "k:", lw=1, label="chance")
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(floor, 1),
        ylim=(floor, 1.05),
        xlabel="false positive rate",
        ylabel="true positive rate",
        title="LiRA ROC",
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".") or "png"
    out = atomic_write(path, lambda p: fig.savefig(p, format=suffix, dpi=150))
    plt.close(fig)
    return out
