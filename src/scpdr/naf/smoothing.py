"""The smoothing S_m of §4.1 (Alg. 1): which m tokens keep their relative probability, and the
smoothed RPDs and distributions built from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from scpdr.naf.checks import DEFAULT_M, as_float32, check_base, check_logps, check_m
from scpdr.naf.floor import floored, floored_pair, scratch

__all__ = [
    "Smoothing",
    "kept_tokens",
    "smooth",
    "smoothed_logps",
    "smoothed_rpds",
    "smoothing",
    "top_m_indices",
]

#: Block length used to find the top-m smoothing scores (see :func:`top_m_indices`).
TOPK_BLOCK = 64


def _block_size(vocab: int, k: int) -> int:
    """Block length for :func:`_top_k_unordered`, or 0 to use a plain ``torch.topk``."""
    for blk in range(TOPK_BLOCK, TOPK_BLOCK // 4, -1):
        if vocab % blk == 0:
            return blk if k * blk * 4 <= vocab else 0
    return 0


def _top_k_unordered(score: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Values and indices of k largest entries per row ``(R, V)`` (unordered; on ties any).

    Faster than ``torch.topk`` for k << V: the rows are cut into blocks, the k blocks with the
    largest maxima are kept (they hold k entries at least as large as any entry outside them),
    and the top k of those ``k * block`` candidates is taken. The *values* are exactly the k
    largest (as a multiset); which of several equal entries comes back is arbitrary.
    """
    vocab = score.shape[-1]
    blk = _block_size(vocab, k)
    if blk == 0:
        return torch.topk(score, k, dim=-1, sorted=False)
    blocks = score.view(-1, vocab // blk, blk)  # (R, nb, blk)
    top_blocks = torch.topk(blocks.amax(dim=-1), k, dim=-1, sorted=False).indices  # (R, k)
    cand = blocks.gather(1, top_blocks.unsqueeze(-1).expand(-1, k, blk))  # (R, k, blk)
    vals, j = torch.topk(cand.reshape(-1, k * blk), k, dim=-1, sorted=False)  # (R, k)
    idx = top_blocks.gather(1, j.div(blk, rounding_mode="floor")).mul_(blk).add_(j % blk)
    return vals, idx


def top_m_indices(score: Tensor, m: int) -> Tensor:
    """The m largest entries of each row, **ties broken by the smaller index**: ``(..., V)`` ->
    ``LongTensor[..., m]`` (unordered). This is S_m's kept set (§4.1; see :func:`smooth`).

    The top m + 1 values come from :func:`_top_k_unordered`; where the m-th and (m + 1)-th
    largest differ (the usual case) the top m is unique and those indices are returned. Where
    they are equal, the rows are recomputed exactly: every entry above the m-th value, then
    the entries equal to it in index order until m are kept.
    """
    vocab = score.shape[-1]
    lead = score.shape[:-1]
    flat = score.reshape(-1, vocab)  # (R, V)
    vals, idx = _top_k_unordered(flat, m + 1)  # (R, m + 1)
    order = vals.argsort(dim=-1, descending=True)
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)  # by decreasing value
    tie = vals[:, m - 1] == vals[:, m]  # (R,)
    if not bool(tie.any()):
        return idx[:, :m].reshape(*lead, m)
    out = idx[:, :m].clone()
    rows = tie.nonzero().squeeze(-1)
    sub = flat[rows]  # (T, V): the tied rows
    thr = vals[rows, m - 1 : m]  # (T, 1): the m-th largest value
    above = sub > thr
    equal = sub == thr
    room = m - above.sum(dim=-1, keepdim=True)  # how many tied entries fit
    keep = above | (equal & (equal.cumsum(dim=-1) <= room))  # exactly m per row
    out[rows] = keep.nonzero()[:, 1].view(-1, m)
    return out.reshape(*lead, m)


class Smoothing(NamedTuple):
    """The pieces of S_m (§4.1) for K constituents; see :func:`smoothing`."""

    y_base: Tensor  # (*batch, V) or broadcastable: floored base log-probs (shifted per row)
    mu_base: Tensor  # (..., 1): mean of y_base, so lr_base = y_base - mu_base
    d: Tensor  # (K, *batch, V): log rp_i - log rb
    idx: Tensor  # (K, *batch, m): kept tokens
    d_top: Tensor  # (K, *batch, m): d at the kept tokens
    c: Tensor  # (K, *batch, 1): sum(d_top) / V, so S_m(rp_i, rb) = lr_base + d [kept] - c


def smoothing(x: Tensor, base: Tensor, m: int) -> Smoothing:
    """S_m (§4.1) of K float32 constituents ``x`` ``(K, *batch, V)`` against float32 ``base``.

    ``S_m(rp, rb)(y) = beta rp(y)`` on the m tokens of largest ``score = p log(rp/rb)`` (ties to
    the smaller token id: :func:`top_m_indices`) and ``beta rb(y)`` elsewhere, with ``log beta
    = -c`` so that the mean log is 0. ``p`` is the floored constituent; its normalizing constant
    does not change the order of the scores, so ``exp(floored(x)) * d`` ranks the tokens. The
    tensors in the result may be scratch views (see :func:`scpdr.naf.floor.scratch`), except
    ``idx`` and ``c``.
    """
    vocab = x.shape[-1]
    buf_y, buf_p, buf_b = scratch([x.shape, x.shape, base.shape], x, base)
    y, _, p = floored_pair(x, out_y=buf_y, out_p=buf_p)  # (K, *batch, V), y up to a shift
    y_base = floored(base, out=buf_b)  # base's own shape
    mu_base = y_base.mean(dim=-1, keepdim=True)
    shift = y.mean(dim=-1, keepdim=True).sub_(mu_base)  # (K, *batch, 1): log tp - log tb
    d = y.sub_(y_base).sub_(shift)  # (K, *batch, V), in place: log rp - log rb
    score = p.mul_(d)  # (K, *batch, V), in place
    idx = top_m_indices(score, m)  # (K, *batch, m)
    d_top = d.gather(-1, idx)  # (K, *batch, m)
    c = d_top.sum(dim=-1, keepdim=True).div_(vocab)  # (K, *batch, 1)
    return Smoothing(y_base, mu_base, d, idx, d_top, c)


def checked_smoothing(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int, method: str, *, min_k: int = 1
) -> tuple[Tensor, Smoothing]:
    """Validate, then :func:`smoothing`: ``(x float32, pieces)``."""
    x = check_logps(logps, method, min_k=min_k)
    b = check_base(base, x, method)
    m = check_m(m, x.shape[-1], method)
    return x, smoothing(x, b, m)


def dense(sm: Smoothing, *, reuse_d: bool = False) -> Tensor:
    """Dense smoothed RPDs ``log S_m(rp_i, rb)`` from the pieces: ``(K, *batch, V)``.

    A new tensor, or with ``reuse_d`` written over ``sm.d`` (which the caller no longer needs).
    """
    lr_base = (sm.y_base - sm.mu_base).expand(sm.d.shape)  # (K, *batch, V)
    s = sm.d.copy_(lr_base) if reuse_d else lr_base.clone()
    return s.scatter_add_(-1, sm.idx, sm.d_top).sub_(sm.c)


def _smoothed(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int, method: str, *, min_k: int = 1
) -> Tensor:
    """Dense smoothed RPDs ``log S_m(rp_i, rb)``: ``(K, *batch, V)``."""
    return dense(checked_smoothing(logps, base, m, method, min_k=min_k)[1])


def smoothed_rpds(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int = DEFAULT_M
) -> Tensor:
    """Smoothed RPDs ``log S_m(rp_i, rb)`` (§4.1) of K constituents: ``Tensor[K, *batch, V]``.

    ``S_m(rp, rb)(y) = beta rp(y)`` on the m tokens of largest ``p(y) log(rp(y)/rb(y))`` and
    ``beta rb(y)`` elsewhere, with ``beta`` chosen so that the mean log is 0 (kept set and ties:
    :func:`smooth`).
    """
    return _smoothed(logps, base, m, "smoothed_rpds")


def smooth(logp: Tensor, log_base: Tensor, m: int = DEFAULT_M) -> Tensor:
    """``log S_m(rp, rb)`` (§4.1) of one distribution: ``Tensor[*batch, V]`` (mean log 0).

    S_m keeps the relative probability of p on the m tokens of largest score ``p(y) log(rp(y) /
    rb(y))`` (p floored, §2.1) and takes the base's elsewhere, both scaled by one ``beta``.

    **Ties.** When several tokens share the m-th largest score (large logits push many tokens
    to the e^-20 floor, where their scores are equal), the tokens with the **smaller ids** are
    kept: the kept set is the first m tokens in the order (score descending, token id
    ascending). Every implementation follows this rule — this torch path on any device
    (:func:`top_m_indices`) and the fused CPU kernel (``scpdr/kernels/scp_delta_r.c``) — so on
    exactly tied scores they keep the same set bit for bit (``tests/test_kernel.py``). Scores
    that differ only by float rounding are not ties: two implementations that round them
    differently may order them differently.

    Args:
        logp: ``(*batch, V)`` logits or log-probs of p (floored first).
        log_base: ``(*batch, V)`` or ``(V,)`` logits or log-probs of the base b (floored first).
        m: number of tokens that keep p's relative probability (1 <= m < V).
    """
    logp = as_float32(logp, "smooth: logp")
    return _smoothed(logp.unsqueeze(0), log_base, m, "smooth")[0]


def kept_tokens(logp: Tensor, log_base: Tensor, m: int = DEFAULT_M) -> Tensor:
    """The m tokens S_m keeps unsmoothed (§4.1): ``LongTensor[*batch, m]`` (unordered).

    The top m of ``score(y) = p(y) log(rp(y)/rb(y))``, ties to the smaller token id — the same
    choice :func:`smooth` makes.
    """
    x = check_logps(as_float32(logp, "kept_tokens: logp").unsqueeze(0), "kept_tokens", min_k=1)
    b = check_base(log_base, x, "kept_tokens")
    m = check_m(m, x.shape[-1], "kept_tokens")
    return smoothing(x, b, m).idx[0]


def smoothed_logps(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int = DEFAULT_M
) -> Tensor:
    """The distributions ``p~_i`` induced by the smoothed RPDs (Alg. 1): ``Tensor[K, *batch, V]``.

    ``log p~_i = log S_m(rp_i, rb) - logsumexp(log S_m(rp_i, rb))`` (normalized log-probs). SCP-Δr
    is CP-Δr of these, so its NAF bound is computed on them (``scpdr.bounds``).
    """
    return torch.log_softmax(_smoothed(logps, base, m, "smoothed_logps"), dim=-1)
