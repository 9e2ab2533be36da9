"""Base-anchored serving: the served distribution brought within a max-log-ratio ``c`` of the base.

The base model never saw the private data, so a distribution ``q`` with

    |log q(y) - log b(y)| <= c   for every token y

is ``c``-close, token by token, to a model that saw no private record at all: a certificate
against every record at once and against the base itself (the reference attack compares the
served log-probs to the base's). ``docs/accountant.md`` ("Anchored to the base") states it as a
proposition with its proof.

The anchored distribution is the mixture, in probability space, of the aggregate ``r`` and the
base ``b`` with the largest weight on ``r`` that stays inside the ball (after PMixED, which
projects each ensemble member onto a Rényi ball around its public model by bisection):

    q_λ = λ r + (1 - λ) b,   λ* = max { λ in [0, 1] : |log q_λ(y) - log b(y)| <= c  for all y }.

With ``ρ(y) = r(y)/b(y)`` the constraint of one token is ``e^-c <= λ(ρ(y) - 1) + 1 <= e^c``,
monotone in λ, so (unlike PMixED's Rényi constraint) the largest λ has a closed form and no
bisection is needed:

    λ* = min(1, (e^c - 1)/(ρ_max - 1) if ρ_max > 1, (1 - e^-c)/(1 - ρ_min) if ρ_min < 1)

with ``ρ_max``, ``ρ_min`` the largest and smallest ratio over the vocabulary (a token neither
gives mass constrains nothing; one the base gives none and r some forces λ* = 0, q = b). λ = 0
always satisfies it. :func:`anchor_weight` computes λ* in float64 from the float32 inputs;
:func:`anchor` mixes in float64 and clips the float32 result into the ball, so the constraint
holds for every token up to the float32 rounding of ``log b(y) ± c``.

"The base" is the floored base ``b~ = naf.normalize(base logits)`` (the e^-20 floor of §2.1):
the distribution the SCP rules smooth against (Alg. 1), as every certificate here refers to the
floored distributions. The floor only raises tokens the raw base gives less than e^-20.

Pure functions of tensors (``*batch`` kept), like :mod:`scpdr.bounds.accountant`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from scpdr.naf import as_float32

__all__ = ["Anchored", "anchor", "anchor_weight"]


class Anchored(NamedTuple):
    """An anchored distribution: ``log_q`` ``(*batch, V)`` float32 (normalized) and the weight
    ``weight`` ``(*batch)`` float64 of the aggregate in it (λ*; 1 where it was inside the ball
    already, or without an anchor)."""

    log_q: Tensor
    weight: Tensor


def _pair(log_r: Tensor, log_base: Tensor, name: str) -> tuple[Tensor, Tensor]:
    lr = torch.log_softmax(as_float32(log_r, f"{name}: log_r"), dim=-1)
    lb = torch.log_softmax(as_float32(log_base, f"{name}: log_base"), dim=-1)
    if lr.shape != lb.shape:
        raise ValueError(
            f"{name}: log_base must have the shape of log_r {tuple(lr.shape)}, got "
            f"{tuple(lb.shape)} (one base distribution per position)"
        )
    return lr, lb


def _radius(c: float | Tensor, batch: torch.Size, device: torch.device, name: str) -> Tensor:
    """``c`` as float64 ``(*batch)`` (``+inf``: no anchor); ValueError unless every c >= 0."""
    if isinstance(c, Tensor):
        cc = c.to(device=device, dtype=torch.float64)
    elif isinstance(c, (int, float)) and not isinstance(c, bool):
        cc = torch.tensor(float(c), dtype=torch.float64, device=device)
    else:
        raise TypeError(f"{name}: c must be a number of nats or a Tensor[*batch], got {c!r}")
    if bool((torch.isnan(cc) | (cc < 0)).any()):
        raise ValueError(f"{name}: c must be >= 0 nats per token (+inf: no anchor), got {c!r}")
    return cc.expand(batch)


def _weight(lr: Tensor, lb: Tensor, cc: Tensor) -> Tensor:
    d = lr.double() - lb.double()  # (*batch, V): log ρ(y)
    both = torch.isneginf(lr) & torch.isneginf(lb)  # neither gives y mass: no constraint
    d = d.masked_fill(both, 0.0).nan_to_num(nan=math.inf)  # a broken input: the safe side
    d_max, d_min = d.amax(dim=-1), d.amin(dim=-1)  # (*batch)
    inf = torch.full_like(d_max, math.inf)
    # ρ_max > 1: λ(ρ - 1) + 1 <= e^c  <=>  λ <= expm1(c) / expm1(log ρ_max)
    hi = torch.where(d_max > 0, torch.expm1(cc) / torch.expm1(d_max), inf)
    # ρ_min < 1: λ(ρ - 1) + 1 >= e^-c  <=>  λ <= -expm1(-c) / -expm1(log ρ_min)
    lo = torch.where(d_min < 0, torch.expm1(-cc) / torch.expm1(d_min), inf)
    lam = torch.minimum(hi, lo).nan_to_num(nan=0.0).clamp(0.0, 1.0)
    return lam.masked_fill(torch.isinf(cc), 1.0)  # no anchor: r itself


def anchor_weight(log_r: Tensor, log_base: Tensor, c: float | Tensor) -> Tensor:
    """The largest λ in [0, 1] with ``|log(λ r + (1 - λ) b) - log b| <= c`` at every token.

    Args:
        log_r: ``(*batch, V)`` log-probs of the aggregate (any float dtype, ``-inf`` allowed;
            ``log_softmax`` is applied, which changes normalized inputs only by rounding).
        log_base: ``(*batch, V)`` log-probs of the (floored) base.
        c: the radius in nats, one number or ``Tensor[*batch]`` (``+inf``: no anchor, λ = 1).

    Returns ``Tensor[*batch]`` float64: the closed form of the module docstring (exact up to
    float64 rounding; PMixED's bisection is not needed for a max-log-ratio ball).
    """
    lr, lb = _pair(log_r, log_base, "anchor_weight")
    return _weight(lr, lb, _radius(c, lr.shape[:-1], lr.device, "anchor_weight"))


def anchor(log_r: Tensor, log_base: Tensor, c: float | Tensor) -> Anchored:
    """The served distribution of base-anchored serving: ``q = λ* r + (1 - λ*) b``.

    Arguments as :func:`anchor_weight`. Returns :class:`Anchored`: ``log_q`` float32 with
    ``|log q(y) - log b(y)| <= c`` for every y (up to the float32 rounding of ``log b(y) ± c``;
    ``log q(y) = -inf`` exactly where the base gives y nothing and λ* = 0), and λ*. Rows with
    ``c = +inf``, or already inside the ball (λ* = 1), return ``log_softmax(log_r)`` unchanged.
    The inputs are not modified.
    """
    lr, lb = _pair(log_r, log_base, "anchor")
    cc = _radius(c, lr.shape[:-1], lr.device, "anchor")
    lam = _weight(lr, lb, cc)  # (*batch) float64
    w = lam.unsqueeze(-1)  # (*batch, 1)
    mixed = torch.logaddexp(w.log() + lr.double(), torch.log1p(-w) + lb.double())  # (*batch, V)
    ball = cc.unsqueeze(-1).to(torch.float32)  # (*batch, 1)
    finite = torch.isfinite(cc).unsqueeze(-1)
    lo = torch.where(finite, lb - ball, -math.inf)  # (*batch, V); no ball where c = inf
    hi = torch.where(finite, lb + ball.masked_fill(~finite, 0.0), math.inf)
    log_q = torch.minimum(torch.maximum(mixed.float(), lo), hi)
    return Anchored(torch.where(w >= 1.0, lr, log_q), lam)
