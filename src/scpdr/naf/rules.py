"""The NAF aggregation rules (none, CP-Δ, CP-ΔKL, CP-Δr, SCP-Δr, SCP-Δ), their registry and
:func:`aggregate`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from scpdr import kernels
from scpdr.errors import ConfigError
from scpdr.naf.checks import DEFAULT_M, check_base, check_logps, check_m
from scpdr.naf.floor import floored, normalized, scratch
from scpdr.naf.smoothing import Smoothing, checked_smoothing, dense, smoothing

__all__ = [
    "METHODS",
    "SCP_CHUNK_ELEMENTS",
    "SCP_METHODS",
    "aggregate",
    "aggregate_with_components",
    "cp_delta",
    "cp_delta_r",
    "cp_kl",
    "none",
    "scp_delta",
    "scp_delta_r",
    "scp_delta_r_torch",
]

#: SCP-Δr's torch path works through the batch in chunks of at most this many (constituent x
#: row x vocab) elements (21 rows for K = 2, V = 49152), which bounds its intermediates.
SCP_CHUNK_ELEMENTS = 1 << 21
#: Methods that smooth against a base model and therefore need ``base`` and ``m``.
SCP_METHODS = frozenset({"scp-delta-r", "scp-delta"})
#: Up to this m the torch path finds which constituents keep each token of the union by
#: comparing indices pairwise; above it, by a (K, *batch, V) mask.
_COMPARE_MAX_M = 32


def none(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """No aggregation: constituent 0, floored and normalized (the "No CP" rows). K >= 1."""
    x = check_logps(logps, "none", min_k=1)
    return normalized(x[0])


def cp_delta(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-Δ (Def. 2.2) for K >= 2: ``r(y) = min_i p_i(y) / Z``, ``Z = sum_y min_i p_i(y)``.

    NAF-tight under the max divergence with ``k_x = D_m(p, q)`` for K = 2 (Thm. 2.3, ``thm:cp_d``).
    ``base`` and ``m`` are ignored. Returns ``log r``: ``Tensor[*batch, V]``.
    """
    x = check_logps(logps, "cp-delta", min_k=2)
    return torch.log_softmax(normalized(x, use_scratch=True).amin(dim=0), dim=-1)


def cp_kl(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-ΔKL (§2.5, Vyas et al. 2023): the normalized geometric mean of the constituents.

    ``r(y) ∝ (prod_i p_i(y))^(1/K)``, which minimizes ``sum_i KL(r || p_i)``. Returns
    ``log r``: ``Tensor[*batch, V]``. ``base`` and ``m`` are ignored.
    """
    x = check_logps(logps, "cp-kl", min_k=2)
    y = floored(x, out=scratch([x.shape], x)[0])  # (K, *batch, V)
    return torch.log_softmax(y.mean(dim=0), dim=-1)


def cp_delta_r(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-Δr (Def. 2.6): ``r(y) = min_i rp_i(y) / Z`` over the RPDs (Def. 2.5), K >= 2.

    NAF-tight under the relative max divergence with ``k_x = D_r(p, q)`` for K = 2 (Thm. 2.7,
    ``thm:cp_dr``). Returns ``log r``: ``Tensor[*batch, V]``. ``base`` and ``m`` are ignored.
    """
    x = check_logps(logps, "cp-delta-r", min_k=2)
    y = floored(x, out=scratch([x.shape], x)[0])  # (K, *batch, V)
    lr = y.sub_(y.mean(dim=-1, keepdim=True))  # (K, *batch, V) log RPDs
    return torch.log_softmax(lr.amin(dim=0), dim=-1)


def scp_delta_r(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """SCP-Δr (Alg. 1): CP-Δr of the smoothed RPDs ``S_m(rp_i, rb)`` (§4.1), K >= 2.

    Equal to :func:`cp_delta_r` without its floor applied to :func:`smoothed_logps`, computed
    sparsely: ``S_m(rp_i, rb) = lr_base - c_i`` except on the m tokens kept for constituent i,
    so ``min_i S_m(rp_i, rb) = lr_base + g`` with ``g = -max_i c_i`` off the union U of kept
    tokens. Only the ``K·m`` entries of U are computed exactly; the constant is absorbed by the
    final ``log_softmax`` (as is the per-row shift between ``lr_base`` and the floored base).

    Args:
        logps: ``(K, *batch, V)`` constituents' logits or log-probs.
        base: ``(*batch, V)`` base logits/log-probs, or ``(V,)`` constant logits ('c' variant).
        m: tokens kept unsmoothed per constituent (1 <= m < V; ties: :func:`smooth`).

    Returns ``log r``: ``Tensor[*batch, V]``.

    On CPU without autograd the fused C kernel (:mod:`scpdr.kernels.scp`) computes the same
    thing to float rounding where it is measured faster than :func:`scp_delta_r_torch` on this
    machine (``SCPDR_NAF_KERNEL=0``/``1`` forces either); elsewhere, the torch implementation.
    """
    x = check_logps(logps, "scp-delta-r", min_k=2)  # float32 from here on: no second copy
    b = check_base(base, x, "scp-delta-r")
    m = check_m(m, x.shape[-1], "scp-delta-r")
    lib = kernels.scp.chosen(x, b, m, lambda: _scp_delta_r(x, b, m, components=False)[0])
    if lib is not None:
        return kernels.scp.run(lib, x, b, m)  # type: ignore[return-value]
    return _scp_delta_r(x, b, m, components=False)[0]


def scp_delta_r_torch(
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = DEFAULT_M,
    chunk_elements: int | None = None,
) -> Tensor:
    """:func:`scp_delta_r` computed by its torch implementation on any device (never the C
    kernel): the reference the kernel is tested and measured against. The batch is worked
    through in chunks of at most ``chunk_elements`` (default :data:`SCP_CHUNK_ELEMENTS`)
    constituent elements; every row is computed the same way whatever the chunking."""
    x = check_logps(logps, "scp-delta-r", min_k=2)
    b = check_base(base, x, "scp-delta-r")
    m = check_m(m, x.shape[-1], "scp-delta-r")
    return _scp_delta_r(x, b, m, components=False, chunk_elements=chunk_elements)[0]


def _scp_delta_r(
    x: Tensor, b: Tensor, m: int, *, components: bool, chunk_elements: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """SCP-Δr of validated float32 inputs and optionally its smoothed components
    (:func:`smoothed_logps`), over chunks of the batch (which bound the intermediates, so they
    fit the scratch buffer at any batch size)."""
    k, shape, vocab = x.shape[0], tuple(x.shape[1:]), x.shape[-1]
    n = math.prod(shape[:-1])
    rows = max(1, (chunk_elements or SCP_CHUNK_ELEMENTS) // (k * vocab))
    if n <= rows and not components:  # one chunk: skip the bookkeeping (it shows at batch 1)
        return _scp_delta_r_sparse(smoothing(x, b, m), shape), None
    xf = x.reshape(k, n, vocab)  # (K, N, V)
    bf = b.reshape(vocab) if b.numel() == vocab else b.expand(shape).reshape(n, vocab)
    out = torch.empty((n, vocab), device=x.device)
    comps = torch.empty((k, n, vocab), device=x.device) if components else None
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        sm = smoothing(xf[:, start:stop], bf if bf.ndim == 1 else bf[start:stop], m)
        if comps is not None:
            torch.log_softmax(dense(sm), dim=-1, out=comps[:, start:stop])
        _scp_delta_r_sparse(sm, (stop - start, vocab), out=out[start:stop])
    return out.reshape(shape), None if comps is None else comps.reshape(k, *shape)


def _scp_delta_r_sparse(
    sm: Smoothing, shape: tuple[int, ...], *, out: Tensor | None = None
) -> Tensor:
    """SCP-Δr from the smoothing pieces (see :func:`scp_delta_r`); ``shape = (*batch, V)``.

    Consumes ``sm.y_base`` (modified in place when it has the full shape).
    """
    k, m = sm.idx.shape[0], sm.idx.shape[-1]
    union = sm.idx.movedim(0, -2).reshape(*shape[:-1], k * m)  # (*batch, K*m), with duplicates
    d_union = sm.d.gather(-1, union.unsqueeze(0).expand(k, *union.shape))  # (K, *batch, K*m)
    if m <= _COMPARE_MAX_M:  # (K, *batch, K*m): constituent i keeps the union's token
        kept = (union.unsqueeze(0).unsqueeze(-1) == sm.idx.unsqueeze(-2)).any(dim=-1)
    else:  # the pairwise comparison would be (K, *batch, K*m, m): a mask over V instead
        mask = torch.zeros(sm.d.shape, dtype=torch.bool, device=sm.d.device)
        kept = mask.scatter_(-1, sm.idx, True).gather(
            -1, union.unsqueeze(0).expand(k, *union.shape)
        )
    g = torch.where(kept, d_union, 0.0).sub_(sm.c).amin(dim=0)  # (*batch, K*m)
    g.add_(sm.c.amax(dim=0))  # minus g off the union, (*batch, 1)
    y_base = sm.y_base
    if tuple(y_base.shape) != shape:  # a broadcast base ('c' variant)
        y_base = y_base.expand(shape).contiguous()
    u = y_base.scatter_(-1, union, y_base.gather(-1, union).add_(g))  # (*batch, V), in place
    if out is None:
        return torch.log_softmax(u, dim=-1)
    return torch.log_softmax(u, dim=-1, out=out)


def scp_delta(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """SCP-Δ, the paper's ablation (§5.4, "Combining smoothing with raw probabilities").

    Smooth each constituent's RPD with S_m (§4.1), normalize each into a distribution ``p~_i``
    (:func:`smoothed_logps`), then CP-Δ (Def. 2.2) on those raw probabilities. K >= 2.
    Returns ``log r``: ``Tensor[*batch, V]``.
    """
    _, sm = checked_smoothing(logps, base, m, "scp-delta", min_k=2)
    s = dense(sm, reuse_d=True)  # (K, *batch, V)
    return torch.log_softmax(torch.log_softmax(s, dim=-1).amin(dim=0), dim=-1)


def aggregate_with_components(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = DEFAULT_M,
) -> tuple[Tensor, Tensor]:
    """``(aggregate(method, ...), components)`` in one pass: the aggregate ``(*batch, V)`` and
    the K distributions ``(K, *batch, V)`` its NAF guarantee refers to.

    The components are the floored constituents (:func:`normalize`), or for the SCP methods the
    smoothed distributions ``p~_i`` (:func:`smoothed_logps`), computed from the same smoothing
    as the aggregate. The aggregate is bit-identical to the torch path (for SCP-Δr,
    :func:`scp_delta_r_torch`); :func:`aggregate` on CPU may use the fused kernel, which agrees
    to float rounding (~1e-5) and keeps the same tokens on exact ties, so callers that certify
    the served distribution take both from here.
    """
    fn = _lookup(method)
    if method not in SCP_METHODS:
        k_min = 1 if method == "none" else 2
        comps = normalized(check_logps(logps, method, min_k=k_min))
        return fn(logps, base=base, m=m), comps
    x = check_logps(logps, method, min_k=2)
    b = check_base(base, x, method)
    m = check_m(m, x.shape[-1], method)
    if method == "scp-delta-r":
        log_r, comps = _scp_delta_r(x, b, m, components=True)
        assert comps is not None
        return log_r, comps
    comps = torch.log_softmax(dense(smoothing(x, b, m)), dim=-1)  # (K, *batch, V)
    return torch.log_softmax(comps.amin(dim=0), dim=-1), comps


#: Aggregation rules by name (STYLE.md 5, after Opacus ``accountants/registry.py``).
METHODS: dict[str, Callable[..., Tensor]] = {
    "none": none,
    "cp-delta": cp_delta,
    "cp-kl": cp_kl,
    "cp-delta-r": cp_delta_r,
    "scp-delta-r": scp_delta_r,
    "scp-delta": scp_delta,
}


def aggregate(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = DEFAULT_M,
) -> Tensor:
    """Aggregate K constituents with the NAF rule ``method``: ``Tensor[*batch, V]`` log-probs.

    Args:
        method: one of :data:`METHODS` ("none", "cp-delta", "cp-kl", "cp-delta-r",
            "scp-delta-r", "scp-delta").
        logps: ``(K, *batch, V)`` logits or log-probs; K >= 2 (K = 1 only for "none").
        base: ``(*batch, V)`` or ``(V,)`` base logits (SCP methods only).
        m: smoothing level for the SCP methods (1 <= m < V).

    Returns normalized float32 log-probs ``(*batch, V)``; inputs are never modified.

    Raises:
        ConfigError (a ValueError): unknown method, or m out of range.
        ValueError: bad shapes, K too small, missing base.
        VocabularyMismatchError: base and constituents differ in vocabulary size.
    """
    return _lookup(method)(logps, base=base, m=m)


def _lookup(method: str) -> Callable[..., Tensor]:
    try:
        return METHODS[method]
    except (KeyError, TypeError):
        hint = (
            "; CP-Fuse is stateful (it needs the path log-probs): use cp_fuse_step"
            if method == "cp-fuse"
            else ""
        )
        raise ConfigError(
            f"unknown NAF method {method!r}; known methods: {', '.join(METHODS)}{hint}"
        ) from None
