"""Per-position NAF certificates: ``k_x`` (Def. 2.1), ``t_x`` (Thm. 4.4) and ``v_x`` (Thm. 4.5).

:func:`certify` is the one formula for a position's certificate ``(k_x, t_x)``, given the served
distribution and the distributions its guarantee refers to; :func:`k_x` and :func:`t_x` (from
raw constituents) and the runtime (``scpdr.runtime``, at every decoded or scored position) both
call it. Which divergence each rule is certified in comes from :mod:`scpdr.methods`.

Paper numbers: Def. 2.1 (``def:naf``), Thm. 2.3 (``thm:cp_d``, CP-Δ: ``k_x = D_m``), Thm. 2.7
(``thm:cp_dr``, CP-Δr: ``k_x = D_r``), Alg. 1 and §4.1 (SCP-Δr certifies the smoothed
distributions), Thm. 4.4 (``theorem:tde_q``, ``t_x``), Thm. 4.5 (``theorem:scp_tde_tight``,
``v_x``), Remark 4.7 (its CP-Δ variant).

The method-level functions take the same raw inputs as :func:`scpdr.naf.aggregate` and floor them
the same way, so that they certify exactly the distribution ``aggregate`` returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from scpdr import methods, naf
from scpdr.bounds.divergences import (
    DIVERGENCES,
    max_divergence,
    relative_max_divergence,
)
from scpdr.naf import as_float32, check_logps

__all__ = [
    "KX_DIVERGENCE",
    "V_X_METHODS",
    "Certificate",
    "certify",
    "k_x",
    "naf_components",
    "t_x",
    "v_x",
]

#: The divergence under which each stateless rule's NAF bound ``k_x`` is stated (from
#: :func:`scpdr.methods.kx_divergence`).
KX_DIVERGENCE: dict[str, str] = {
    r: methods.kx_divergence(r) for r in methods.RULES if r in methods.STATELESS_RULES
}
#: Rules with a LiRA bound ``v_x`` (Thm. 4.5 and Remark 4.7): :data:`scpdr.methods.V_X_RULES`.
V_X_METHODS: tuple[str, ...] = methods.V_X_RULES
#: Rules whose ``t_x`` is ``k_x``: the max divergence bounds the ratio pointwise (Thm. 2.3, §4.2).
_T_IS_K = frozenset(r for r, d in KX_DIVERGENCE.items() if d == "max" and r != "none")


class Certificate(NamedTuple):
    """The certificate of one served distribution per position, each ``Tensor[*batch]``.

    ``k_x``: the NAF bound ``max_i Δ(r || p_i)`` under the rule's divergence (Def. 2.1);
    ``t_x``: the LiRA bound ``max_y log r(y)/q(y) <= t_x`` for ``r_0 = q`` (Thm. 4.4).
    """

    k_x: Tensor
    t_x: Tensor


def _check_method(method: str, allowed: Sequence[str], what: str) -> None:
    if method not in allowed:
        raise methods.UnknownMethodError(
            f"{what}: unknown or unsupported method {method!r}; known: {', '.join(allowed)}"
        )


def certify(rule: str, log_r: Tensor, comps: Tensor, *, ref: int | None = None) -> Certificate:
    """The certificate ``(k_x, t_x)`` of the served distribution ``r`` at each position.

    Args:
        rule: the aggregation rule that produced ``log_r`` (a name of
            :data:`scpdr.methods.RULES`; "cp-fuse" has no NAF theorem of its own: its ``k_x``
            is the exact max divergence to each constituent).
        log_r: ``(*batch, V)`` normalized log-probs of ``r``.
        comps: ``(K, *batch, V)`` the distributions the guarantee refers to: the floored
            constituents, or the smoothed ``p~_i`` for the SCP rules (:func:`naf_components`).
        ref: index of the constituent playing ``q`` in ``t_x``; ``None`` takes the max over all,
            so the bound holds for every one of them.

    Formulas (each ``max_i`` over the K components):

    - max divergence (CP-Δ, SCP-Δ on ``p~``): ``k_x = max_i Δ(r || p_i)`` (= ``D_m(p, q)`` for
      K = 2, Thm. 2.3) and ``t_x = k_x`` (the max divergence bounds the ratio pointwise);
    - relative max divergence (CP-Δr, SCP-Δr on ``p~``): ``k_x = max_i Δ_r(r || p_i)``
      (= ``D_r(p, q)`` for K = 2, Thm. 2.7) and ``t_x = log(tr / tq) + k_x`` (Thm. 4.4; with the
      smoothed ``q~`` for SCP-Δr, §4.2);
    - KL (CP-ΔKL), "none" with K >= 2 and CP-Fuse, without a LiRA theorem: ``k_x`` in the rule's
      divergence and the exact ``t_x = max_y log r(y)/q(y)``;
    - "none" with K = 1 (no other model to compare): ``+inf`` for both.
    """
    k = comps.shape[0]
    if ref is not None and not (isinstance(ref, int) and -k <= ref < k):
        raise ValueError(f"t_x: ref must be a constituent index in [0, {k}), got {ref!r}")
    if rule == "none" and k == 1:
        inf = torch.full(log_r.shape[:-1], math.inf, device=log_r.device)
        return Certificate(inf, inf)
    div = "max" if rule == "cp-fuse" else methods.kx_divergence(rule)
    kx = DIVERGENCES[div](log_r, comps).amax(dim=0)  # (*batch)
    sel = comps if ref is None else comps[ref].unsqueeze(0)  # (K or 1, *batch, V)
    if rule in _T_IS_K:
        tx = kx
    elif div == "relative-max":
        tx = (log_r.mean(dim=-1) - sel.mean(dim=-1)).amax(dim=0) + kx  # Thm. 4.4
    elif ref is None and div == "max":
        tx = kx  # the max over all constituents of max_y log r/q is k_x itself
    else:
        tx = max_divergence(log_r, sel).amax(dim=0)
    return Certificate(kx, tx)


def naf_components(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> tuple[Tensor, Tensor]:
    """``(log r, log p_i)``: the aggregate and the K distributions its NAF guarantee refers to.

    ``log r = naf.aggregate(method, ...)`` ``(*batch, V)``; the components ``(K, *batch, V)`` are
    the floored constituents, or for the SCP methods the smoothed distributions ``p~_i``
    (:func:`scpdr.naf.smoothed_logps`, Alg. 1), from one smoothing pass
    (:func:`scpdr.naf.aggregate_with_components`).
    """
    _check_method(method, tuple(KX_DIVERGENCE), "k_x")
    return naf.aggregate_with_components(method, logps, base=base, m=m)


def k_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> Tensor:
    """The NAF bound of ``method`` at each position: ``k_x = max_i Δ(r || p_i)``, ``Tensor[*batch]``.

    Computed exactly (Def. 2.1) under the method's divergence (:data:`KX_DIVERGENCE`): max
    divergence for CP-Δ and SCP-Δ (on the smoothed ``p~_i``), relative max divergence for CP-Δr
    and SCP-Δr (on the smoothed RPDs), KL for CP-ΔKL. For K = 2 this equals ``D_m(p, q)``
    (Thm. 2.3) and ``D_r(p, q)`` (Thm. 2.7): the rules are NAF-tight. For "none" it is
    ``max_i Δ(p_0 || p_i)`` (max divergence), and ``+inf`` when K = 1 (no guarantee at all).
    See :func:`certify`.
    """
    if method == "none":
        x = check_logps(logps, "none", min_k=1)
        if x.shape[0] == 1:
            return torch.full(x.shape[1:-1], math.inf)
    log_r, comps = naf_components(method, logps, base=base, m=m)
    return certify(method, log_r, comps).k_x


def t_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
    ref: int | None = None,
) -> Tensor:
    """LiRA bound for ``r_0 = q``: ``max_y log r(y)/q(y) <= t_x`` (Thm. 4.4), ``Tensor[*batch]``.

    - CP-Δr / SCP-Δr: ``t_x = log(tr / tq) + k_x`` (Thm. 4.4), with the smoothed ``q~`` for
      SCP-Δr (``log tq~ = -logsumexp(log rq~)``).
    - CP-Δ / SCP-Δ: ``t_x = k_x`` (the max divergence bounds the ratio pointwise, §2.3).
    - CP-ΔKL and "none" have no such theorem: the exact ``max_y log r(y)/q(y)`` is returned
      (``+inf`` for "none" with K = 1).

    ``ref`` is the index of the constituent playing q; ``None`` takes the max over all
    constituents, so the bound holds for every one of them. See :func:`certify`.
    """
    log_r, comps = naf_components(method, logps, base=base, m=m)
    return certify(method, log_r, comps, ref=ref).t_x


def v_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    ref_logp: Tensor,
    y: Tensor | None = None,
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> Tensor:
    """LiRA bound for ``r_0 = CP(p_0, q)``: ``log r_1(y) - log r_0(y) <= v_x(y)`` (Thm. 4.5).

    ``r_i = CP(p_i, q)`` with ``logps[0] = p_1``, ``logps[1] = q`` and ``ref_logp = p_0``:

    - CP-Δr: ``v_x(y) = log max(1, rq(y)/rp_0(y)) + log(tr_1/tr_0) + k_x``, ``k_x = D_r(p_1, q)``;
    - SCP-Δr: the same on the smoothed RPDs ``rq~``, ``rp~_0`` with ``r_i = SCP-Δr(p_i, q)``;
    - CP-Δ (Remark 4.7): ``v_x(y) = log max(1, q(y)/p_0(y)) + k_x``, ``k_x = D_m(p_1, q)``.

    Args:
        logps: ``(2, *batch, V)`` logits/log-probs of ``p_1`` and ``q``.
        ref_logp: ``(*batch, V)`` logits/log-probs of ``p_0``.
        y: ``LongTensor[*batch]`` target tokens, or ``None`` for every token.
        base, m: as in :func:`scpdr.naf.aggregate` (SCP-Δr).

    Returns ``Tensor[*batch]`` at ``y``, or ``Tensor[*batch, V]`` when ``y`` is None.
    """
    _check_method(method, V_X_METHODS, "v_x")
    x1 = check_logps(logps, method, min_k=2)
    if x1.shape[0] != 2:
        raise ValueError(f"v_x: logps must stack exactly (p_1, q), K = 2; got K = {x1.shape[0]}")
    x0 = as_float32(ref_logp, "v_x: ref_logp")
    if tuple(x0.shape) != tuple(x1.shape[1:]):
        raise ValueError(
            f"v_x: ref_logp (p_0) must have the shape of one constituent {tuple(x1.shape[1:])}, "
            f"got {tuple(x0.shape)}"
        )
    x0q = torch.stack([x0, x1[1]])  # (2, *batch, V): p_0 and q
    log_r1, c1 = naf_components(method, x1, base=base, m=m)
    log_r0, c0 = naf_components(method, x0q, base=base, m=m)
    if method == "cp-delta":
        kx = max_divergence(log_r1, c1).amax(dim=0)  # = D_m(p_1, q)
        v = (c0[1] - c0[0]).clamp_min(0.0) + kx.unsqueeze(-1)  # (*batch, V)
    else:
        kx = relative_max_divergence(log_r1, c1).amax(dim=0)  # = D_r(p_1, q)
        lrq = c0[1] - c0[1].mean(dim=-1, keepdim=True)
        lrp0 = c0[0] - c0[0].mean(dim=-1, keepdim=True)
        log_t = log_r1.mean(dim=-1) - log_r0.mean(dim=-1)  # log tr_1 / tr_0
        v = (lrq - lrp0).clamp_min(0.0) + (log_t + kx).unsqueeze(-1)
    if y is None:
        return v
    if not isinstance(y, Tensor) or y.dtype not in (torch.int64, torch.int32):
        raise TypeError("v_x: y must be an integer LongTensor[*batch] of token ids (or None)")
    if tuple(y.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"v_x: y must have shape {tuple(v.shape[:-1])}, got {tuple(y.shape)}")
    return v.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
