"""The membership-inference suite auditors run, one function per attack, all on the same members
and non-members (issue "A privacy audit that holds up"; mimir, Duan et al. 2024).

Every attack turns what the TDE game (Def. 4.1) lets an adversary observe — the target's
next-token distribution of each prefix, sent as a fresh prompt — into one membership score per
example, **higher = predicted member**:

========  ===========================================================================  ===========
attack    score of an example with scored tokens y_1..y_L                              reference
========  ===========================================================================  ===========
loss      mean_t log r(y_t | y_<t)  (Yeom et al. 2018)                                  none
zlib      sum_t log r(y_t | y_<t) / zlib bytes of the text (Carlini et al. 2021)       none
min-k     mean of the k% lowest log r(y_t | y_<t)  (Shi et al. 2024)                   none
min-k++   mean of the k% lowest (log r(y_t) − μ_t) / σ_t, μ_t and σ_t² the mean and    none
          variance of log r(z) for z ~ r(· | y_<t)  (Zhang et al. 2024)
ref       sum_t [log r(y_t | y_<t) − log b(y_t | y_<t)], b = the bundle's base model   base model
lira      sum_t [log r_1(y_t | y_<t) − log r_0(y_t | y_<t)], r_0 = the method over p0  (offline
          trained without the members (§4.2, Thm 4.5: the worst-case reference)        LiRA)
========  ===========================================================================  ===========

``ref`` and ``lira`` are log-likelihood ratios of the scored continuation (the chain rule sums
per-token ratios), the statistic the paper's bounds t_x / v_x constrain (Thm 4.4, 4.5).

:func:`scores_from_stats` computes the reference-free scores from per-token statistics;
:func:`mia_rows` turns member/non-member scores into result rows (ROC AUC, TPR at 1% and 0.1%
FPR, each with a bootstrap 95% CI, ``n_members``/``n_nonmembers``) via
:func:`scpdr.attacks.stats.roc_metrics` (scikit-learn).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.stats import FPR_LEVELS, N_BOOT, RocMetrics, roc_metrics

__all__ = [
    "DEFAULT_K",
    "MIA_ATTACKS",
    "MIA_METRICS",
    "REFERENCE_FREE",
    "ExampleStats",
    "MIAScores",
    "loss_score",
    "metric_name",
    "mia_rows",
    "min_k_plus_plus_score",
    "min_k_score",
    "ratio_score",
    "scores_from_stats",
    "zlib_score",
]

#: The suite, in report order.
MIA_ATTACKS: tuple[str, ...] = ("loss", "zlib", "min-k", "min-k++", "ref", "lira")
#: Attacks that need no reference model.
REFERENCE_FREE: tuple[str, ...] = ("loss", "zlib", "min-k", "min-k++")
#: The fraction of lowest-scoring tokens Min-K% and Min-K%++ average (both papers' default).
DEFAULT_K = 0.2


def metric_name(level: float) -> str:
    """``"tpr@0.01fpr"`` for 0.01: the result-row metric of TPR at FPR ``level``."""
    return f"tpr@{level:g}fpr"


#: Result-row metrics of every MIA attack.
MIA_METRICS: tuple[str, ...] = ("auc", *(metric_name(lv) for lv in FPR_LEVELS))


def _lp(token_logprobs: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_logprobs, dtype=np.float64).ravel()
    if arr.size == 0:
        raise ValueError("an example with no scored tokens has no membership score")
    return arr


def _lowest_mean(values: np.ndarray, k: float) -> float:
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k must be in (0, 1] (a fraction of the tokens), got {k}")
    n = max(1, int(values.size * k))
    return float(np.mean(np.partition(values, n - 1)[:n]))


def loss_score(token_logprobs: Sequence[float] | np.ndarray) -> float:
    """LOSS: the mean token log-likelihood (the negative of the loss)."""
    return float(np.mean(_lp(token_logprobs)))


def zlib_score(token_logprobs: Sequence[float] | np.ndarray, text: str) -> float:
    """zlib: the sequence log-likelihood over the zlib-compressed length of its text in bytes
    (Carlini et al. 2021's ratio; mimir's ``loss / zlib_entropy`` up to sign and length)."""
    size = len(zlib.compress(text.encode("utf-8")))
    return float(np.sum(_lp(token_logprobs))) / max(size, 1)


def min_k_score(token_logprobs: Sequence[float] | np.ndarray, *, k: float = DEFAULT_K) -> float:
    """Min-K% Prob: the mean of the ``k`` fraction of lowest token log-probs (at least one)."""
    return _lowest_mean(_lp(token_logprobs), k)


def min_k_plus_plus_score(
    token_logprobs: Sequence[float] | np.ndarray,
    mu: Sequence[float] | np.ndarray,
    sigma: Sequence[float] | np.ndarray,
    *,
    k: float = DEFAULT_K,
) -> float:
    """Min-K%++: each token's log-prob standardized by the mean ``mu`` and standard deviation
    ``sigma`` of the log-prob of a token drawn from the same next-token distribution, then the
    mean of the ``k`` fraction of lowest (Zhang et al. 2024, Eq. 4). A position whose
    distribution is a point mass (``sigma`` = 0) contributes 0."""
    lp = _lp(token_logprobs)
    mu_a = np.asarray(mu, dtype=np.float64).ravel()
    sd = np.asarray(sigma, dtype=np.float64).ravel()
    if mu_a.shape != lp.shape or sd.shape != lp.shape:
        raise ValueError(
            f"mu and sigma need one value per scored token ({lp.size}), got {mu_a.size} and "
            f"{sd.size}"
        )
    z = np.divide(lp - mu_a, sd, out=np.zeros_like(lp), where=sd > 0)
    return _lowest_mean(z, k)


def ratio_score(
    target_logprobs: Sequence[float] | np.ndarray,
    reference_logprobs: Sequence[float] | np.ndarray,
) -> float:
    """``ref`` / ``lira``: the log-likelihood ratio of the scored tokens, target vs reference
    (summed over tokens: the chain rule)."""
    t, r = _lp(target_logprobs), _lp(reference_logprobs)
    if t.shape != r.shape:
        raise ValueError(f"target and reference scored {t.size} and {r.size} tokens")
    return float(np.sum(t - r))


@dataclass(frozen=True)
class ExampleStats:
    """What the target reveals about one example's scored tokens (float64 arrays, one entry per
    token): the log-prob of each actual token, and the mean/std of the log-prob of a token drawn
    from the same next-token distribution (for Min-K%++); ``text`` is what zlib compresses."""

    logprobs: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray
    text: str


def scores_from_stats(stats: ExampleStats, *, k: float = DEFAULT_K) -> dict[str, float]:
    """The reference-free scores (:data:`REFERENCE_FREE`) of one example."""
    return {
        "loss": loss_score(stats.logprobs),
        "zlib": zlib_score(stats.logprobs, stats.text),
        "min-k": min_k_score(stats.logprobs, k=k),
        "min-k++": min_k_plus_plus_score(stats.logprobs, stats.mu, stats.sigma, k=k),
    }


@dataclass
class MIAScores:
    """Every attack's scores of the members and the non-members of one method (raw scores are
    kept, so any metric can be recomputed: ML Privacy Meter's habit)."""

    method: str
    members: dict[str, list[float]] = field(default_factory=dict)
    nonmembers: dict[str, list[float]] = field(default_factory=dict)

    def add(self, attack: str, *, member: bool, score: float) -> None:
        side = self.members if member else self.nonmembers
        side.setdefault(attack, []).append(float(score))

    def metrics(self, attack: str, *, n_boot: int = N_BOOT, seed: int = 0) -> RocMetrics:
        return roc_metrics(
            self.members.get(attack, []),
            self.nonmembers.get(attack, []),
            n_boot=n_boot,
            seed=seed,
        )

    def attacks(self) -> list[str]:
        return [a for a in MIA_ATTACKS if self.members.get(a) and self.nonmembers.get(a)]


def mia_rows(
    scores: MIAScores,
    *,
    corpus: str | None = None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    extra: Mapping[str, object] | None = None,
) -> list[ResultRow]:
    """Result rows of every attack ``scores`` holds: metrics :data:`MIA_METRICS`, each with
    ``ci_low``/``ci_high``, ``n_members``, ``n_nonmembers`` (``n`` = both together)."""
    rows = []
    for attack in scores.attacks():
        met = scores.metrics(attack, n_boot=n_boot, seed=seed)
        ests = {"auc": met.auc, **{metric_name(lv): e for lv, e in met.tpr.items()}}
        for metric, est in ests.items():
            rows.append(
                ResultRow(
                    scores.method,
                    attack,
                    metric,
                    est.value,
                    n=est.n,
                    corpus=corpus,
                    extra={
                        "ci_low": est.ci_low,
                        "ci_high": est.ci_high,
                        "n_members": met.n_members,
                        "n_nonmembers": met.n_nonmembers,
                        **(extra or {}),
                    },
                )
            )
    return rows
