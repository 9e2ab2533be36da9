"""The NAF accountant: a per-token charge whose sum certifies a whole response, and budgets.

A client extracts *sequences* and a membership test sums evidence over tokens. By the chain rule
the likelihood ratio of a response ``y_1..y_T`` (given ``x``) against a constituent is the product
of its tokens' ratios, so its log is the **sum** of theirs; the per-token bound ``t_x`` of
Thm. 4.4 (``theorem:tde_q``) therefore composes into ``Σ_t t_x`` for a response, and the charge
``cost_t`` below into the tighter ``Σ_t cost_t`` (``docs/accountant.md``, Proposition 1, with its
proof).

The charge at one position with context ``c`` (prompt and the tokens served before it), served
distribution ``r(·|c)`` and the K distributions ``p~_i(·|c)`` its guarantee refers to (the floored
constituents for CP-Δ / CP-Δr, Thms. 2.3 / 2.7; the smoothed constituents of Alg. 1 for SCP-Δr,
§4.1-4.2 — :func:`scpdr.bounds.naf_components`), when the client sees the tokens ``R`` (the
emitted or echoed token, plus any alternatives whose log-probs are returned)::

    cost = min(t_x, max(0, max_i max_{z in R} log r(z|c) - log p~_i(z|c)))

with ``t_x`` from :func:`scpdr.bounds.certify` (the one certificate formula). So
``log r(z|c)/p~_i(z|c) <= cost <= t_x`` for every constituent i and every revealed z: at least the
realized log-likelihood ratio of everything the client was shown, never more than the worst case
(Thm. 4.4; for CP-Δ the max divergence, Thm. 2.3). A rule without a certificate ("none" on one
model: ``t_x = +inf``) is charged ``+inf``.

Everything here is a pure function of tensors (float32, ``*batch`` kept), like
:mod:`scpdr.bounds.certificates`; the runtime (``scpdr.runtime``) charges each decoded or echoed
position with :func:`token_cost`, and :func:`within_budget` is its budget rule on a whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from scpdr import naf
from scpdr.bounds.certificates import certify, naf_components
from scpdr.naf import as_float32

__all__ = [
    "Charge",
    "charge",
    "private_prefix",
    "realized_log_lr",
    "response_certificate",
    "sequence_charges",
    "token_cost",
    "within_budget",
]


class Charge(NamedTuple):
    """One position's certificate and charge, each ``Tensor[*batch]``: ``k_x`` (Def. 2.1),
    ``t_x`` (Thm. 4.4) and ``cost`` (realized, ``<= t_x``)."""

    k_x: Tensor
    t_x: Tensor
    cost: Tensor


def _check(log_r: Tensor, comps: Tensor, name: str) -> tuple[Tensor, Tensor]:
    lr = as_float32(log_r, f"{name}: log_r")
    lp = as_float32(comps, f"{name}: comps")
    if lp.ndim != lr.ndim + 1 or tuple(lp.shape[1:]) != tuple(lr.shape):
        raise ValueError(
            f"{name}: comps must have shape (K, *log_r.shape) = (K, {tuple(lr.shape)}), got "
            f"{tuple(lp.shape)}"
        )
    return lr, lp


def _ids(tokens: Tensor, name: str) -> Tensor:
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer LongTensor of token ids")
    return tokens.long()


def _log_lr(lr: Tensor, lp: Tensor, idx: Tensor) -> Tensor:
    """``log r(z) - log p_i(z)`` at ``idx`` ``(*batch, R)`` (ids >= 0): ``(K, *batch, R)``.

    A token r gives probability 0 is never observed: -inf (also where p_i(z) = 0 too, which
    would be NaN); NaN anywhere else (a broken input) counts as +inf, the conservative side."""
    safe = idx.clamp_min(0)
    lr_z = lr.gather(-1, safe)  # (*batch, R)
    lp_z = lp.gather(-1, safe.unsqueeze(0).expand(lp.shape[0], *safe.shape))  # (K, *batch, R)
    delta = (lr_z.unsqueeze(0) - lp_z).nan_to_num(nan=math.inf, posinf=math.inf)
    return delta.masked_fill(torch.isneginf(lr_z).unsqueeze(0), -math.inf)


def realized_log_lr(log_r: Tensor, comps: Tensor, tokens: Tensor) -> Tensor:
    """The log-likelihood ratio of ``tokens`` against each component:
    ``log r(y) - log p~_i(y)``, ``Tensor[K, *batch]``.

    Args:
        log_r: ``(*batch, V)`` normalized log-probs of the served distribution.
        comps: ``(K, *batch, V)`` the distributions its guarantee refers to.
        tokens: ``LongTensor[*batch]`` the observed token at each position.

    Summed over the positions of a sequence this is the sequence's log-likelihood ratio (chain
    rule), the statistic the certificate ``Σ cost`` bounds. ``-inf`` where ``r(y) = 0``.
    """
    lr, lp = _check(log_r, comps, "realized_log_lr")
    y = _ids(tokens, "realized_log_lr: tokens")
    if tuple(y.shape) != tuple(lr.shape[:-1]):
        raise ValueError(
            f"realized_log_lr: tokens must have shape {tuple(lr.shape[:-1])}, got {tuple(y.shape)}"
        )
    if bool(((y < 0) | (y >= lr.shape[-1])).any()):
        raise ValueError(f"realized_log_lr: token ids must be in [0, {lr.shape[-1]})")
    return _log_lr(lr, lp, y.unsqueeze(-1)).squeeze(-1)


def token_cost(log_r: Tensor, comps: Tensor | None, revealed: Tensor, t_x: Tensor) -> Tensor:
    """The charge of each position: ``min(t_x, max(0, max_i max_{z in R} log r(z)/p~_i(z)))``.

    Args:
        log_r: ``(*batch, V)`` normalized log-probs of the served distribution r.
        comps: ``(K, *batch, V)`` the distributions its certificate refers to (the runtime's
            :class:`~scpdr.runtime.aggregation.Aggregator` returns them), or None when there are
            none (method "none" on one model): then the charge is ``+inf``.
        revealed: ``LongTensor[*batch, R]`` the tokens whose log-prob the client sees at the
            position (the emitted or echoed token first, then the returned alternatives);
            negative ids fill rows that reveal fewer than R.
        t_x: ``Tensor[*batch]`` the position's LiRA bound (:func:`scpdr.bounds.certify`).

    Returns ``Tensor[*batch]`` float32 in ``[0, t_x]`` (``+inf`` without a certificate). A
    position that reveals nothing costs 0.
    """
    if not isinstance(t_x, Tensor) or not t_x.is_floating_point():
        raise TypeError("token_cost: t_x must be a floating-point Tensor[*batch]")
    tx = t_x.float()
    if comps is None:
        return torch.full_like(tx, math.inf)
    lr, lp = _check(log_r, comps, "token_cost")
    idx = _ids(revealed, "token_cost: revealed")
    if idx.ndim != lr.ndim or tuple(idx.shape[:-1]) != tuple(lr.shape[:-1]):
        raise ValueError(
            f"token_cost: revealed must have shape (*batch, R) = ({tuple(lr.shape[:-1])}, R), "
            f"got {tuple(idx.shape)}"
        )
    if tuple(tx.shape) != tuple(lr.shape[:-1]):
        raise ValueError(
            f"token_cost: t_x must have shape {tuple(lr.shape[:-1])}, got {tuple(tx.shape)}"
        )
    if bool((idx >= lr.shape[-1]).any()):
        raise ValueError(f"token_cost: revealed token ids must be < V = {lr.shape[-1]}")
    if idx.shape[-1] == 0:
        return torch.zeros_like(tx)
    delta = _log_lr(lr, lp, idx).masked_fill((idx < 0).unsqueeze(0), -math.inf)
    realized = delta.amax(dim=0).amax(dim=-1).clamp_min(0.0)  # (*batch)
    return torch.minimum(realized, tx)


def charge(rule: str, log_r: Tensor, comps: Tensor, revealed: Tensor) -> Charge:
    """:func:`scpdr.bounds.certify` plus :func:`token_cost`: the certificate and the charge of
    each position of ``log_r`` ``(*batch, V)`` whose client sees the tokens ``revealed``
    ``(*batch, R)`` (``comps`` as in :func:`certify`; "none" on one model is charged +inf)."""
    cert = certify(rule, log_r, comps)
    none = rule == "none" and comps.shape[0] == 1
    return Charge(
        cert.k_x, cert.t_x, token_cost(log_r, None if none else comps, revealed, cert.t_x)
    )


def sequence_charges(
    method: str,
    logps: Tensor | Sequence[Tensor],
    tokens: Tensor,
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
    top_logprobs: int = 0,
) -> Charge:
    """The charges of a teacher-forced sequence under a stateless rule (as ``aggregate``).

    Args:
        logps: ``(K, *batch, V)`` the constituents' logits at each position (the last batch
            dimension is usually the sequence's positions).
        tokens: ``LongTensor[*batch]`` the token observed at each position.
        base, m: as in :func:`scpdr.naf.aggregate`.
        top_logprobs: the client also sees the log-probs of r's ``top_logprobs`` most likely
            tokens at every position (charged too).

    Returns the :class:`Charge` of every position, ``Tensor[*batch]`` each; ``Σ cost`` over a
    sequence's positions is its certificate (:func:`response_certificate`).
    """
    log_r, comps = naf_components(method, logps, base=base, m=m)
    y = _ids(tokens, "sequence_charges: tokens")
    if tuple(y.shape) != tuple(log_r.shape[:-1]):
        raise ValueError(
            f"sequence_charges: tokens must have shape {tuple(log_r.shape[:-1])}, got "
            f"{tuple(y.shape)}"
        )
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
    revealed = y.unsqueeze(-1)
    n = min(top_logprobs, log_r.shape[-1])
    if n:
        revealed = torch.cat([revealed, torch.topk(log_r, n, dim=-1).indices], dim=-1)
    return charge(method, log_r, comps, revealed)


def response_certificate(cost: Tensor, t_x: Tensor) -> tuple[Tensor, Tensor]:
    """``(Σ_t cost_t, Σ_t t_x)`` over the last dimension (a response's positions): the response's
    certificate and its worst case (Proposition 1 of ``docs/accountant.md``), in float64."""
    return cost.double().sum(dim=-1), t_x.double().sum(dim=-1)


def within_budget(cost: Tensor, budget: float | None) -> Tensor:
    """Which positions a budget of ``budget`` nats serves: ``BoolTensor`` of ``cost``'s shape
    ``(*batch, T)``, a prefix of each row.

    The runtime's rule: a position whose charge would take the response's running sum past the
    budget is not served, nor is anything after it (the response ends there). The sums are
    float64 running sums, as the runtime keeps them. ``None`` (or +inf) serves everything.
    """
    if budget is None or budget == math.inf:
        return torch.ones_like(cost, dtype=torch.bool)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(f"budget must be a number of nats >= 0 (or None), got {budget!r}")
    ok = cost.double().cumsum(dim=-1) <= float(budget)
    return ok.long().cumprod(dim=-1).bool()  # stop at the first position past it


def private_prefix(cost: Tensor, worst: Tensor, budget: float | None) -> Tensor:
    """Which positions the fallback to the base (``on_budget="base"``) serves from the private
    aggregate: ``BoolTensor`` of ``cost``'s shape ``(*batch, T)``, a prefix of each row.

    Position t is private when ``Σ_{s<t} cost_s + worst_t <= budget`` and every earlier position
    was private: the decision is taken *before* the token at t is drawn, on the position's worst
    case ``worst_t`` (its ``t_x``, Thm. 4.4), so it never depends on the draw; from the first
    position that fails it, the response continues from the base (``docs/accountant.md``,
    Proposition 3). ``cost``/``worst`` are the private aggregate's charges and worst cases at every
    position (a teacher-forced trace, ``ProtectedLM.score(..., cost=True, t_x=True)``); float64
    running sums, as the runtime keeps them. ``None`` (or +inf) serves everything privately.
    """
    if tuple(worst.shape) != tuple(cost.shape):
        raise ValueError(
            f"private_prefix: worst must have the shape of cost {tuple(cost.shape)}, got "
            f"{tuple(worst.shape)}"
        )
    if budget is None or budget == math.inf:
        return torch.ones_like(cost, dtype=torch.bool)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(f"budget must be a number of nats >= 0 (or None), got {budget!r}")
    c = cost.double()
    before = torch.cat([torch.zeros_like(c[..., :1]), c.cumsum(dim=-1)[..., :-1]], dim=-1)
    ok = before + worst.double() <= float(budget)
    return ok.long().cumprod(dim=-1).bool()
