"""Uncertainty for every reported number: bootstrap 95% confidence intervals, membership-inference
ROC metrics with their intervals, and the one test of "distinguishable from a reference row".

STYLE.md 15 (after ML Privacy Meter and mimir): a number travels with its sample size and a CI,
and "indistinguishable from chance" is a statement about the CI, never about a point estimate.

- :func:`bootstrap_ci`: percentile bootstrap over examples of any statistic of one sample
  (means, fractions, percentiles).
- :func:`pooled_mean_ci` / :func:`cluster_bootstrap_ci`: the same over examples when the number is
  pooled over their tokens (TTE, utility): whole examples are resampled, so the interval reflects
  the example-to-example spread, not the (correlated) tokens'.
- :func:`roc_metrics`: ROC AUC and TPR at fixed FPRs from scikit-learn's ``roc_auc_score`` /
  ``roc_curve``, each with a stratified bootstrap CI (members and non-members resampled
  separately, so every replicate keeps both classes).
- :func:`distinguishable`: whether two independent estimates differ at the 95% level, from their
  intervals (normal approximation of the difference).

Every function is deterministic given ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

__all__ = [
    "CI_LEVEL",
    "FPR_LEVELS",
    "N_BOOT",
    "Estimate",
    "RocMetrics",
    "bootstrap_ci",
    "bootstrap_replicates",
    "ci_extra",
    "cluster_bootstrap_ci",
    "distinguishable",
    "pairwise_weighted_roc",
    "pooled_mean_ci",
    "ranked_weighted_roc",
    "roc_metrics",
    "tpr_at_fpr",
    "weighted_roc",
]

#: Confidence level of every interval scpdr reports.
CI_LEVEL = 0.95
#: Bootstrap replicates (a percentile interval at 95% is stable to ~0.01 at 1000).
N_BOOT = 1000
#: False-positive rates at which membership attacks report their TPR (Carlini et al. 2022).
FPR_LEVELS: tuple[float, ...] = (0.01, 0.001)
_Z = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class Estimate:
    """A number with its sample size and ``CI_LEVEL`` interval (``nan`` bounds: no interval,
    e.g. a single example)."""

    value: float
    ci_low: float
    ci_high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2.0

    def contains(self, x: float) -> bool:
        return bool(self.ci_low <= x <= self.ci_high)


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or infinite values; drop or clip them first")
    return arr


def _percentiles(stats: np.ndarray, level: float) -> tuple[float, float]:
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    # interpolation can step outside the replicates by one ulp (all-equal replicates)
    return float(np.clip(lo, stats.min(), stats.max())), float(
        np.clip(hi, stats.min(), stats.max())
    )


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[..., np.ndarray] = np.mean,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> Estimate:
    """``statistic(values)`` with a percentile-bootstrap interval over the examples.

    Args:
        values: one number per example (an extracted length, a 0/1 success, an exposure).
        statistic: a reduction accepting ``axis=-1`` (``np.mean``, ``np.median``, a percentile
            via ``functools.partial(np.percentile, q=95)``).
        n_boot: bootstrap replicates; seed: the resampling seed; level: the interval's level.

    A constant sample gets the degenerate interval ``[v, v]``; fewer than two examples get
    ``nan`` bounds (no interval can be estimated).
    """
    arr = _as_1d(values, "values")
    n = int(arr.size)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    value = float(statistic(arr, axis=-1))
    if n < 2:
        return Estimate(value, float("nan"), float("nan"), n)
    lo, hi = _percentiles(bootstrap_replicates(arr, statistic, n_boot=n_boot, seed=seed), level)
    # a percentile interval of a skewed statistic can miss the point estimate by rounding only
    return Estimate(value, min(lo, value), max(hi, value), n)


def bootstrap_replicates(
    values: np.ndarray,
    statistic: Callable[..., np.ndarray] = np.mean,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> np.ndarray:
    """``float64[n_boot]``: ``statistic`` of each bootstrap resample of ``values`` (the
    replicates :func:`bootstrap_ci` reads its interval off; the same for the same seed)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(n_boot, values.size))  # (n_boot, n)
    return np.asarray(statistic(values[idx], axis=-1), dtype=np.float64)


def ci_extra(est: Estimate) -> dict[str, float]:
    """The result-row keys of an interval: ``{"ci_low", "ci_high"}``."""
    return {"ci_low": est.ci_low, "ci_high": est.ci_high}


def _resampled_counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``(n_boot, n)``: how often each of ``n`` examples is drawn in each replicate."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)


def pooled_mean_ci(
    sums: Sequence[float] | np.ndarray,
    counts: Sequence[float] | np.ndarray,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> Estimate:
    """``sum(sums) / sum(counts)`` — a mean pooled over the tokens of several examples (example
    ``i`` contributes ``counts[i]`` tokens summing to ``sums[i]``) — with a percentile interval
    from resampling whole examples. ``n`` is the number of examples."""
    s = _as_1d(sums, "sums")
    c = _as_1d(counts, "counts")
    if s.shape != c.shape:
        raise ValueError(f"sums {s.shape} and counts {c.shape} differ in shape")
    keep = c > 0
    s, c = s[keep], c[keep]
    n = int(s.size)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    value = float(s.sum() / c.sum())
    if n < 2:
        return Estimate(value, float("nan"), float("nan"), n)
    w = _resampled_counts(n, n_boot, seed)  # (n_boot, n)
    lo, hi = _percentiles((w @ s) / (w @ c), level)
    return Estimate(value, min(lo, value), max(hi, value), n)


def cluster_bootstrap_ci(
    n: int,
    statistic: Callable[[np.ndarray], float],
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> Estimate:
    """``statistic(arange(n))`` with a percentile interval over resampled examples:
    ``statistic`` takes the indices of the examples of one replicate (with repeats) and pools
    whatever it needs from them (e.g. the accuracy–coverage AUC of their tokens)."""
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    value = float(statistic(np.arange(n)))
    if n < 2:
        return Estimate(value, float("nan"), float("nan"), n)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    reps = np.array([statistic(np.sort(row)) for row in idx], dtype=np.float64)
    lo, hi = _percentiles(reps, level)
    return Estimate(value, min(lo, value), max(hi, value), n)


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, level: float) -> float:
    """The largest TPR among ROC points with FPR ≤ ``level`` (with fewer than ``1/level``
    non-members only FPR = 0 qualifies: report ``n_nonmembers`` beside it)."""
    ok = fpr <= level + 1e-12
    return float(tpr[ok].max()) if ok.any() else 0.0


@dataclass(frozen=True)
class RocMetrics:
    """A membership test's ROC summary: ``auc`` and ``tpr[level]`` (for each of
    :data:`FPR_LEVELS`), with intervals; the curve itself for plots."""

    auc: Estimate
    tpr: dict[float, Estimate]
    fpr_curve: np.ndarray
    tpr_curve: np.ndarray
    n_members: int
    n_nonmembers: int


def _roc_point(members: np.ndarray, nonmembers: np.ndarray, levels: Sequence[float]):
    """scikit-learn's AUC, TPR at each level and the curve of one sample."""
    y = np.r_[np.ones(members.size), np.zeros(nonmembers.size)]
    s = np.r_[members, nonmembers]
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    return float(roc_auc_score(y, s)), [tpr_at_fpr(fpr, tpr, lv) for lv in levels], fpr, tpr


#: Below this many member × non-member pairs the pairwise form is the faster one
#: (``benchmarks/bench_stats.py``: crossover between 10 and 40 of each, with numpy/OpenBLAS on
#: AVX-512 and forced to AVX2 — NPY_DISABLE_CPU_FEATURES=X86_V4, OPENBLAS_CORETYPE=Haswell).
PAIRWISE_MAX_PAIRS = 1024


def weighted_roc(
    members: np.ndarray,
    nonmembers: np.ndarray,
    member_weights: np.ndarray,
    nonmember_weights: np.ndarray,
    levels: Sequence[float],
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ranked_weighted_roc`, or :func:`pairwise_weighted_roc` for fewer than
    :data:`PAIRWISE_MAX_PAIRS` pairs (the same values; whichever is faster)."""
    fn = (
        pairwise_weighted_roc
        if members.size * nonmembers.size <= PAIRWISE_MAX_PAIRS
        else ranked_weighted_roc
    )
    return fn(members, nonmembers, member_weights, nonmember_weights, levels)


def ranked_weighted_roc(
    members: np.ndarray,
    nonmembers: np.ndarray,
    member_weights: np.ndarray,
    nonmember_weights: np.ndarray,
    levels: Sequence[float],
) -> tuple[np.ndarray, np.ndarray]:
    """AUC ``(R,)`` and TPR at each level ``(R, len(levels))`` of ``R`` weighted copies of one
    sample at once (the bootstrap: weights = how often each example was drawn).

    Row r weighs member i by ``member_weights[r, i]`` and non-member j by
    ``nonmember_weights[r, j]``; with all weights 1 it equals :func:`_roc_point` (scikit-learn;
    tested). AUC = Σ_ij v_i w_j ([m_i > n_j] + ½[m_i = n_j]) / (Σv Σw). TPR at FPR ≤ α: among
    thresholds "score > u" for u a non-member value (or none), the lowest whose false positives
    stay within α·Σw, and the member weight above it. Cost O(R · (M + N)) after sorting: each
    member's rank among the sorted non-members indexes the replicates' cumulative weights (the
    O(R · M · N) definition: :func:`pairwise_weighted_roc`).
    """
    v = np.asarray(member_weights, dtype=np.float64)  # (R, M)
    w = np.asarray(nonmember_weights, dtype=np.float64)  # (R, N)
    n_rep = w.shape[0]
    rows = np.arange(n_rep)[:, None]
    tot_v, tot_w = v.sum(1), w.sum(1)  # (R,)
    # AUC: member i beats the non-members below it and ties half of those equal to it
    order = np.argsort(nonmembers, kind="stable")
    sorted_non = nonmembers[order]
    cum_w = np.concatenate([np.zeros((n_rep, 1)), np.cumsum(w[:, order], 1)], 1)  # (R, N+1)
    below = np.searchsorted(sorted_non, members, side="left")  # (M,): non-members < m_i
    upto = np.searchsorted(sorted_non, members, side="right")  # (M,): non-members <= m_i
    beaten = cum_w[rows, below] + 0.5 * (cum_w[rows, upto] - cum_w[rows, below])  # (R, M)
    auc = (v * beaten).sum(1) / (tot_v * tot_w)
    u, inv = np.unique(nonmembers, return_inverse=True)  # ascending distinct values (K,)
    u, inv = u[::-1], (u.size - 1) - inv  # descending: u[0] the largest
    counts = np.zeros((n_rep, u.size))
    np.add.at(counts.T, inv, w.T)  # (R, K): weight of each distinct value
    fp = np.concatenate([np.zeros((n_rep, 1)), np.cumsum(counts, 1)], 1)  # (R, K+1)
    # fp[:, k] = weight of non-members >= u[k-1]: the false positives of "score > u[k]".
    # Member i is above u[k] from k = first[i] on (u descending; k = K is "no threshold")
    first = u.size - np.searchsorted(u[::-1], members, side="left")  # (M,): #{u >= m_i}
    gained = np.zeros((n_rep, u.size + 1))
    np.add.at(gained.T, first, v.T)
    tp = np.cumsum(gained, 1)  # (R, K+1): member weight above u[k]
    tprs = np.empty((n_rep, len(levels)))
    for c, lv in enumerate(levels):
        ok = fp <= lv * tot_w[:, None] + 1e-9  # monotone: a prefix of the columns
        k = ok.sum(1) - 1  # the last threshold within the level
        tprs[:, c] = tp[np.arange(n_rep), k] / tot_v
    return auc, tprs


def pairwise_weighted_roc(
    members: np.ndarray,
    nonmembers: np.ndarray,
    member_weights: np.ndarray,
    nonmember_weights: np.ndarray,
    levels: Sequence[float],
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`weighted_roc` by its definition, every member against every non-member
    (O(R · M · N)): the slow reference of the tests and ``benchmarks/bench_stats.py``."""
    v = np.asarray(member_weights, dtype=np.float64)
    w = np.asarray(nonmember_weights, dtype=np.float64)
    kernel = (members[:, None] > nonmembers[None, :]) + 0.5 * (
        members[:, None] == nonmembers[None, :]
    )
    auc = np.einsum("rm,mn,rn->r", v, kernel, w) / (v.sum(1) * w.sum(1))
    thresholds = np.r_[np.unique(nonmembers)[::-1], -np.inf]
    fp = w @ (nonmembers[:, None] > thresholds[None, :])  # (R, K+1)
    tp = v @ (members[:, None] > thresholds[None, :])
    tprs = np.empty((v.shape[0], len(levels)))
    for c, lv in enumerate(levels):
        k = (fp <= lv * w.sum(1)[:, None] + 1e-9).sum(1) - 1
        tprs[:, c] = tp[np.arange(v.shape[0]), k] / v.sum(1)
    return auc, tprs


def roc_metrics(
    member_scores: Sequence[float] | np.ndarray,
    nonmember_scores: Sequence[float] | np.ndarray,
    *,
    fpr_levels: Sequence[float] = FPR_LEVELS,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> RocMetrics:
    """ROC AUC and TPR at ``fpr_levels`` of a membership score (higher = predicted member), from
    scikit-learn, with stratified percentile-bootstrap intervals.

    Ties count one half in the AUC (the Mann–Whitney statistic). An AUC below 0.5 is leakage too
    (the test flipped); callers that rank protection use ``|AUC − 0.5|``.

    Raises:
        ValueError: no members or no non-members, or a non-finite score.
    """
    mem = _as_1d(member_scores, "member_scores")
    non = _as_1d(nonmember_scores, "nonmember_scores")
    if mem.size == 0 or non.size == 0:
        raise ValueError(
            f"a ROC needs members and non-members, got {mem.size} and {non.size}: give the "
            "attack examples of both"
        )
    levels = tuple(float(lv) for lv in fpr_levels)
    auc, tprs, fpr, tpr = _roc_point(mem, non, levels)
    rng = np.random.default_rng(seed)
    # bootstrap replicates as draw counts, members and non-members resampled separately
    v = rng.multinomial(mem.size, np.full(mem.size, 1.0 / mem.size), size=n_boot)
    w = rng.multinomial(non.size, np.full(non.size, 1.0 / non.size), size=n_boot)
    b_auc, b_tpr = weighted_roc(mem, non, v, w, levels)
    boot = np.column_stack([b_auc, b_tpr])  # (n_boot, 1 + levels)
    small = mem.size < 2 or non.size < 2

    def est(value: float, col: int) -> Estimate:
        if small:
            return Estimate(value, float("nan"), float("nan"), int(mem.size + non.size))
        lo, hi = _percentiles(boot[:, col], level)
        return Estimate(value, min(lo, value), max(hi, value), int(mem.size + non.size))

    return RocMetrics(
        auc=est(auc, 0),
        tpr={lv: est(t, 1 + i) for i, (lv, t) in enumerate(zip(levels, tprs, strict=True))},
        fpr_curve=fpr,
        tpr_curve=tpr,
        n_members=int(mem.size),
        n_nonmembers=int(non.size),
    )


def distinguishable(a: Estimate, b: Estimate, *, level: float = CI_LEVEL) -> bool | None:
    """Whether two independent estimates differ at ``level``: the difference's normal-approx
    interval, with each standard error read off its own interval (half-width / z), excludes 0.

    ``None`` when either has no interval. Two identical degenerate intervals (``[v, v]`` twice)
    are not distinguishable; disjoint degenerate ones are.
    """
    vals = (a.value, a.ci_low, a.ci_high, b.value, b.ci_low, b.ci_high)
    if not all(math.isfinite(v) for v in vals):
        return None
    z = _Z if level == CI_LEVEL else float(_normal_quantile(0.5 + level / 2.0))
    se = math.hypot(a.half_width / z, b.half_width / z)
    diff = abs(a.value - b.value)
    if se == 0.0:
        return diff > 0.0
    return diff > z * se


def _normal_quantile(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))
