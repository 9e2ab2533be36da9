"""RMIA: the pairwise likelihood-ratio membership test of Zarifzadeh et al. (ICML 2024, "Low-Cost
High-Power Membership Inference Attacks"), offline with one reference model, on sequences.

For an example ``x`` and a population of non-member samples ``z`` (never the evaluated ``x``
itself), RMIA scores ``x`` by how often its likelihood ratio beats theirs::

    LR(x) = p(x | θ) / p(x)        score(x) = Pr_z[ LR(x) / LR(z) ≥ γ ]        (higher = member)

``p(x | θ)`` is the target's likelihood of the scored tokens and ``p(x)`` the probability of ``x``
averaged over models trained with and without it; with one reference model trained without it
(offline) the paper approximates ``p(x) = ((1 + a)/2) · p_ref(x) + (1 − a)/2`` (a linear fit of the
IN model's probability to the OUT model's, ``a`` tuned on a reference pair; ML Privacy Meter's
default is ``a = 0.3``, ``γ = 1``: :data:`DEFAULT_A`, :data:`DEFAULT_GAMMA`).

Sequences, in log space throughout: the likelihood of a sequence is its per-token geometric mean,
``log p(x | θ) = mean_t log p(x_t | x_<t)`` — ML Privacy Meter's signal for language models
(``exp(−mean token loss)``). The offline approximation is a mixture with a constant of order 1,
so it is only meaningful for probabilities of order 1: a whole sequence's probability (e^-50 for a
50-token text) would make ``p(x)`` the constant ``(1 − a)/2`` and RMIA a plain loss test. The
mixture is computed as ``logaddexp(log((1 + a)/2) + log p_ref, log((1 − a)/2))``; nothing is ever
exponentiated.

The pieces are pure functions of float64 arrays (STYLE.md 1): :func:`log_ratio`,
:func:`dominates` (the pairwise comparison), :func:`rmia_scores`. The MIA suite
(:func:`scpdr.attacks.mia.membership_inference`, attack name ``rmia``) feeds them the target's and
the reference's token log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_A", "DEFAULT_GAMMA", "dominates", "log_ratio", "rmia_scores"]

#: The offline coefficient ``a`` of ``p(x) = ((1 + a)/2) p_ref(x) + (1 − a)/2`` (ML Privacy
#: Meter's default; ``a = 1`` is the reference alone, ``a = 0`` ignores it).
DEFAULT_A = 0.3
#: The threshold γ of the pairwise test ``LR(x) / LR(z) ≥ γ`` (the paper's and ML Privacy Meter's
#: default).
DEFAULT_GAMMA = 1.0


def _check_a(a: float) -> float:
    a = float(a)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"RMIA's offline coefficient a must be in [0, 1], got {a}")
    return a


def log_ratio(
    target_logp: np.ndarray | Sequence[float],
    reference_logp: np.ndarray | Sequence[float],
    *,
    a: float = DEFAULT_A,
) -> np.ndarray:
    """``log LR = log p(x | θ) − log p(x)`` per example (``float64[N]``), from per-example
    log-likelihoods (each the mean token log-prob of the example's scored tokens) of the target
    and of the reference, with the offline ``p(x) = ((1 + a)/2) p_ref(x) + (1 − a)/2``
    in log space."""
    a = _check_a(a)
    t = np.asarray(target_logp, dtype=np.float64).ravel()
    r = np.asarray(reference_logp, dtype=np.float64).ravel()
    if t.shape != r.shape:
        raise ValueError(f"target and reference give {t.size} and {r.size} log-likelihoods")
    const = math.log((1.0 - a) / 2.0) if a < 1.0 else -math.inf
    log_px = np.logaddexp(math.log((1.0 + a) / 2.0) + r, const)  # (N,)
    return t - log_px


def dominates(lr_x: np.ndarray, lr_z: np.ndarray, *, gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """The pairwise comparison ``LR(x) / LR(z) ≥ γ`` of every ``x`` with every ``z``, from log
    ratios: ``float64[N_x, N_z]``, 1 where ``x`` beats ``z``, 0 where it does not, and ½ on an
    exact tie (``LR(x) / LR(z) = γ``), as ROC AUC counts ties — the paper writes ``≥``, ML Privacy
    Meter ``>``; they differ only on ties, which real log-probs almost never produce but
    hand-made models do. Not symmetric: ``dominates(x, z)`` asks whether ``x`` beats ``z``."""
    if not gamma > 0:
        raise ValueError(f"RMIA's threshold gamma must be > 0, got {gamma}")
    x = np.asarray(lr_x, dtype=np.float64).ravel()
    z = np.asarray(lr_z, dtype=np.float64).ravel()
    diff = x[:, None] - z[None, :] - math.log(gamma)  # (N_x, N_z)
    return 0.5 * (1.0 + np.sign(diff))


def rmia_scores(
    lr_x: np.ndarray,
    lr_z: np.ndarray,
    *,
    gamma: float = DEFAULT_GAMMA,
    same: np.ndarray | None = None,
) -> np.ndarray:
    """``score(x) = Pr_z[LR(x) / LR(z) ≥ γ]`` for every ``x`` (``float64[N_x]``, in [0, 1]).

    ``same``: ``bool[N_x, N_z]``, True where ``z`` is ``x`` itself (when the population is the
    evaluated non-members, each is compared with the others only). An ``x`` left with no
    population sample is an error."""
    wins = dominates(lr_x, lr_z, gamma=gamma)  # (N_x, N_z)
    keep = np.ones(wins.shape, dtype=bool) if same is None else ~np.asarray(same, dtype=bool)
    if keep.shape != wins.shape:
        raise ValueError(f"same must be {wins.shape}, got {keep.shape}")
    n = keep.sum(axis=1)  # (N_x,)
    if wins.shape[0] and np.any(n == 0):
        raise ValueError(
            "RMIA needs at least one population sample other than the example itself; "
            "give it more non-members"
        )
    return np.where(keep, wins, 0.0).sum(axis=1) / np.maximum(n, 1)
