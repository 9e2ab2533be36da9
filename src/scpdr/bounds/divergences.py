"""Divergences between next-token distributions: pure functions of log-probability tensors.

Paper numbers (the paper: "Provably Protecting Fine-Tuned LLMs from Training Data Extraction
while Preserving Utility"): Def. 2.1 (``def:naf``: the max divergence a k-NAF bounds),
Thm. 2.3 (``thm:cp_d``: TV and ``D_m``), Def. 2.5 (RPD and typical probability),
Thm. 2.7 (``thm:cp_dr``: ``D_r`` and the relative max divergence); KL is CP-ΔKL's divergence
(§2.5).

Convention: inputs are logits or log-probabilities; ``log_softmax`` is applied (which changes
normalized inputs only by rounding; no floor). Results are float32 and keep ``*batch``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from scpdr.naf import as_float32, check_floating

__all__ = [
    "DIVERGENCES",
    "d_m",
    "d_r",
    "kl_divergence",
    "log_typical",
    "max_divergence",
    "relative_max_divergence",
    "tv",
]


def _lp(x: Tensor, name: str) -> Tensor:
    return torch.log_softmax(as_float32(x, name), dim=-1)


def _check_pair(logp: Tensor, logq: Tensor, name: str) -> tuple[Tensor, Tensor]:
    if logp.shape[-1] != logq.shape[-1]:
        raise ValueError(
            f"{name}: vocabulary sizes differ ({logp.shape[-1]} vs {logq.shape[-1]}); both "
            "distributions must be over one vocabulary"
        )
    return _lp(logp, f"{name}: logp"), _lp(logq, f"{name}: logq")


def tv(logp: Tensor, logq: Tensor) -> Tensor:
    """Total variation ``TV(p, q) = 1/2 sum_y |p(y) - q(y)|`` (Thm. 2.3): ``Tensor[*batch]``."""
    lp, lq = _check_pair(logp, logq, "tv")
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(dim=-1)


def d_m(logp: Tensor, logq: Tensor) -> Tensor:
    """``D_m(p, q) = log 1/(1 - TV(p, q))`` (Thm. 2.3), ``Tensor[*batch]``.

    Computed stably as ``-logsumexp(min(log p, log q))``, since ``1 - TV = sum_y min(p, q)``.
    """
    lp, lq = _check_pair(logp, logq, "d_m")
    return -torch.logsumexp(torch.minimum(lp, lq), dim=-1)


def d_r(logp: Tensor, logq: Tensor) -> Tensor:
    """``D_r(p, q) = 1/(2n) sum_y |log rp(y) - log rq(y)|`` (Thm. 2.7): ``Tensor[*batch]``."""
    lp, lq = _check_pair(logp, logq, "d_r")
    delta = lp - lq
    return 0.5 * (delta - delta.mean(dim=-1, keepdim=True)).abs().mean(dim=-1)


def _check_r_ps(log_r: Tensor, logps: Tensor, name: str) -> Tensor:
    """``log_softmax(log_r)``, once ``logps`` is checked to be ``(K, *log_r.shape)``."""
    lr = _lp(log_r, f"{name}: log_r")
    check_floating(logps, f"{name}: logps")
    if logps.ndim < 2 or tuple(logps.shape[1:]) != tuple(lr.shape):
        raise ValueError(
            f"{name}: logps must have shape (K, *log_r.shape) = (K, {', '.join(map(str, lr.shape))}),"
            f" got {tuple(logps.shape)}"
        )
    return lr


def _per_component(
    log_r: Tensor, logps: Tensor, name: str, reduce: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """``reduce(lr, lr - log p_i)`` for each component i, stacked: ``Tensor[K, *batch]``.

    One component at a time, so the temporaries are one ``(*batch, V)`` tensor, not K of
    them: a teacher-forced score certifies hundreds of positions over the vocabulary at once.
    Each row is normalized and reduced as in one ``(K, *batch, V)`` tensor: the same values, bit
    for bit on one thread (torch may split a single row's sum across threads in another order).
    """
    lr = _check_r_ps(log_r, logps, name)
    out = []
    for i in range(logps.shape[0]):
        delta = _lp(logps[i], f"{name}: logps").neg_().add_(lr)  # log r - log p_i, in place
        out.append(reduce(lr, delta))
    return torch.stack(out)


def max_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """Max divergence ``Δ(r || p_i) = max_y log r(y)/p_i(y)`` (Def. 2.1): ``Tensor[K, *batch]``.

    Args:
        log_r: ``(*batch, V)`` log-probs of the aggregate.
        logps: ``(K, *batch, V)`` log-probs of the constituents.
    """
    return _per_component(log_r, logps, "max_divergence", lambda _, d: d.amax(dim=-1))


def relative_max_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """Relative max divergence ``Δ_r(r || p_i) = max_y log rr(y)/rp_i(y)`` (Thm. 2.7).

    Shapes as :func:`max_divergence`; returns ``Tensor[K, *batch]``. With ``δ = log r - log p``
    it is ``max(δ) - mean(δ)`` (the typical probabilities cancel into the mean).
    """
    return _per_component(
        log_r, logps, "relative_max_divergence", lambda _, d: d.amax(dim=-1) - d.mean(dim=-1)
    )


def kl_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """``KL(r || p_i) = sum_y r(y) log r(y)/p_i(y)`` (CP-ΔKL's divergence): ``Tensor[K, *batch]``."""
    return _per_component(log_r, logps, "kl_divergence", lambda lr, d: d.mul_(lr.exp()).sum(-1))


def log_typical(logp: Tensor) -> Tensor:
    """Log typical probability ``log tp = mean_y log p(y)`` (Def. 2.5): ``Tensor[*batch]``."""
    return _lp(logp, "log_typical: logp").mean(dim=-1)


#: The divergence functions ``(log_r, logps) -> Tensor[K, *batch]`` by the names
#: :func:`scpdr.methods.kx_divergence` gives.
DIVERGENCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "max": max_divergence,
    "relative-max": relative_max_divergence,
    "kl": kl_divergence,
}
