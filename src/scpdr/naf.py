"""NAF aggregation rules: pure functions of ``(K, *batch, V)`` log-probability tensors.

The paper (``shared/paper/scp_dr.tex``) is the source of truth. Numbers below are those of the
compiled paper, where theorems, propositions, lemmas, definitions and remarks share one counter
per section; the LaTeX label is given as well so that a reader of the ``.tex`` file finds them:

- Def. 2.2 (CP-Δ), Thm. 2.3 (``thm:cp_d``, CP-Δ bound),
- Def. 2.5 (RPD), Def. 2.6 (CP-Δr), Thm. 2.7 (``thm:cp_dr``, CP-Δr bound),
- §4.1 smoothing S_m and Alg. 1 (``alg:SCP``, SCP-Δr), Remark 4.1 (``remark:2k_sparps``),
- CP-ΔKL (§2.5, after Vyas et al. 2023) and CP-Fuse (Abad et al. 2025).

Conventions (STYLE.md 1-5, after PEFT ``utils/merge_utils.py``):

- ``logps`` is ``Tensor[K, *batch, V]``: logits or log-probabilities of K constituent models on one
  vocabulary. ``base`` is ``Tensor[*batch, V]`` or a ``(V,)`` vector broadcast over the batch
  (the constant-base 'c' variant of SCP-Δr).
- Every input (each constituent and the base) first goes through :func:`normalize`: ``log_softmax``
  in float32, then ``clamp_min(LOG_FLOOR)`` (every probability at least e^-20, §2.1), then
  renormalization with ``logsumexp``. After renormalization a floored entry sits at
  ``LOG_FLOOR - log Z`` with ``0 <= log Z <= V e^-20`` (at most 1e-4 for V = 49152).
- Every rule returns normalized float32 log-probabilities ``Tensor[*batch, V]``, for float32,
  bfloat16 and float16 inputs alike, and never modifies its inputs.
- A row whose entries are all ``-inf`` has no distribution; its output is NaN. Partially masked
  rows (some ``-inf`` entries) are fine: masked tokens get the floor probability.
- The rules are for inference: they work in place on their own intermediates, so they are not
  differentiable (run them under ``torch.inference_mode()``, as the runtime does).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from scpdr.errors import ConfigError, VocabularyMismatchError

__all__ = [
    "CP_FUSE_CHUNK_ELEMENTS",
    "CP_FUSE_GRID",
    "CP_FUSE_WEIGHTS",
    "DEFAULT_M",
    "LOG_FLOOR",
    "METHODS",
    "SCP_CHUNK_ELEMENTS",
    "SCP_METHODS",
    "SCRATCH_MAX_BYTES",
    "aggregate",
    "aggregate_with_components",
    "cp_delta",
    "cp_delta_r",
    "cp_fuse_step",
    "cp_kl",
    "kept_tokens",
    "none",
    "normalize",
    "rpd",
    "scp_delta",
    "scp_delta_r",
    "smooth",
    "smoothed_logps",
    "smoothed_rpds",
]

#: Log of the probability floor: every distribution gives each token at least e^-20 (§2.1).
LOG_FLOOR = -20.0
#: Default smoothing level m (the paper's default, App. "Choice of smoothing parameter m").
DEFAULT_M = 10
#: CP-Fuse: the values each of the two weights (b1, b2) takes on the default grid.
CP_FUSE_WEIGHTS: tuple[float, ...] = tuple(round(0.2 * i, 1) for i in range(11))
#: CP-Fuse default grid: every pair of :data:`CP_FUSE_WEIGHTS` except (0, 0) (120 points).
CP_FUSE_GRID: tuple[tuple[float, float], ...] = tuple(
    (a, b) for a in CP_FUSE_WEIGHTS for b in CP_FUSE_WEIGHTS if (a, b) != (0.0, 0.0)
)
#: CP-Fuse evaluates the grid in chunks of at most this many (grid point x batch x vocab)
#: elements, so (batch, G, V) is never materialized at once (8 MiB of float32).
CP_FUSE_CHUNK_ELEMENTS = 1 << 21
#: Block length used to find the top-m smoothing scores (see ``_top_m_indices``).
_TOPK_BLOCK = 64
_PROB_FLOOR = math.exp(LOG_FLOOR)
#: On CPU, the rules' large intermediates (never their outputs) live in one cached per-thread
#: buffer of at most this many bytes; see ``_scratch``.
SCRATCH_MAX_BYTES = 64 << 20
#: SCP-Δr works through the batch in chunks of at most this many (constituent x row x vocab)
#: elements (21 rows for K = 2, V = 49152), which bounds its intermediates.
SCP_CHUNK_ELEMENTS = 1 << 21
#: Methods that smooth against a base model and therefore need ``base`` and ``m``.
SCP_METHODS = frozenset({"scp-delta-r", "scp-delta"})


# --------------------------------------------------------------------------------------------
# validation


def _as_float32(x: Tensor, name: str) -> Tensor:
    """``x`` as float32 (no copy when it already is; the caller must not modify the result)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must hold floating-point logits or log-probabilities, got dtype {x.dtype}; "
            "convert with .float()"
        )
    if x.ndim < 1 or x.shape[-1] < 2:
        raise ValueError(
            f"{name} must have a vocabulary dimension of size >= 2 last, got shape {tuple(x.shape)}"
        )
    return x.float()


def _check_logps(logps: Tensor | Sequence[Tensor], method: str, *, min_k: int) -> Tensor:
    """Validate ``logps`` ``(K, *batch, V)`` and return it as float32."""
    if not isinstance(logps, Tensor):
        if isinstance(logps, Sequence) and logps and all(isinstance(t, Tensor) for t in logps):
            shapes = {tuple(t.shape) for t in logps}
            if len(shapes) != 1:
                raise ValueError(
                    f"{method}: the constituents' log-prob tensors differ in shape: "
                    f"{sorted(shapes)}; every constituent must give (*batch, V) on one vocabulary"
                )
            logps = torch.stack(list(logps))
        else:
            raise TypeError(
                f"{method}: logps must be a Tensor[K, *batch, V] (or a list of K Tensor[*batch, V])"
            )
    if logps.ndim < 2:
        raise ValueError(
            f"{method}: logps must have shape (K, *batch, V) with a leading constituent "
            f"dimension, got shape {tuple(logps.shape)}; for a single model use logps[None]"
        )
    k = logps.shape[0]
    if k < min_k:
        raise ValueError(
            f"{method} aggregates K >= {min_k} constituents, got K = {k} "
            f"(logps shape {tuple(logps.shape)}); pass one model per partition along dim 0, "
            "or use method 'none' for a single model"
        )
    return _as_float32(logps, f"{method}: logps")


def _check_base(base: Tensor | None, logps: Tensor, method: str) -> Tensor:
    """Validate ``base`` against ``logps`` ``(K, *batch, V)``; return it as float32.

    The result keeps its own shape (``(*batch, V)`` or anything that broadcasts to it, e.g.
    ``(V,)``); it is not expanded, so per-row work on a constant base is done once.
    """
    if base is None:
        raise ValueError(
            f"{method} smooths against a base model: pass base=Tensor[*batch, V] (the base "
            "model's logits) or base=Tensor[V] (a constant logit vector, the 'c' variant)"
        )
    base = _as_float32(base, f"{method}: base")
    target = tuple(logps.shape[1:])
    if base.shape[-1] != target[-1]:
        raise VocabularyMismatchError(
            f"{method}: base has vocabulary size {base.shape[-1]} but the constituents have "
            f"{target[-1]}; base and constituents must share one tokenizer"
        )
    if base.ndim == 1 or tuple(base.shape) == target:  # the common cases, checked cheaply
        return base
    try:
        shape = torch.broadcast_shapes(tuple(base.shape), target)
    except RuntimeError:
        shape = None
    if shape != target:
        raise ValueError(
            f"{method}: base shape {tuple(base.shape)} does not broadcast to the constituents' "
            f"(*batch, V) = {target}; pass base with shape {target} or ({target[-1]},)"
        )
    return base


def _check_m(m: int, vocab: int, method: str) -> int:
    if isinstance(m, bool) or not isinstance(m, int):
        raise ConfigError(f"{method}: m must be an int (tokens kept unsmoothed), got {m!r}")
    if not 1 <= m < vocab:
        raise ConfigError(
            f"{method}: m must satisfy 1 <= m < V = {vocab} (tokens kept unsmoothed), got m = {m}; "
            f"the paper's default is m = {DEFAULT_M}"
        )
    return m


# --------------------------------------------------------------------------------------------
# floor, RPD, smoothing
#
# Speed notes (benchmarks/bench_naf.py): on CPU the fused ``log_softmax``/``softmax`` kernels are
# faster than ``torch.exp``/``torch.logsumexp`` on the same data, and every fresh tensor of a
# few hundred KiB costs page faults, so the code below uses the fused kernels, works in place
# on tensors it created, and never concatenates.


class _ScratchCache(threading.local):
    buf: Tensor | None = None


_SCRATCH = _ScratchCache()


def _scratch(shapes: Sequence[Sequence[int]], *like: Tensor) -> list[Tensor | None]:
    """``out=`` tensors of ``shapes`` (float32) for intermediates that never leave this module.

    On CPU without autograd they are views of one cached per-thread buffer (at most
    :data:`SCRATCH_MAX_BYTES`): a fresh CPU tensor of a few MiB costs page faults on every call,
    which took longer than the arithmetic of SCP-Δr at batch 8. Otherwise they are None (the
    op allocates; ``out=`` variants have no autograd). The contents are garbage, and the next
    call of any rule overwrites them. Views from two calls alias each other: take every
    scratch tensor a computation needs in one call, and never return one.
    """
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    device = like[0].device
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in like)
    if device.type != "cpu" or grad or total * 4 > SCRATCH_MAX_BYTES:
        return [None] * len(shapes)
    buf = _SCRATCH.buf
    if buf is None or buf.numel() < total:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference
            buf = torch.empty(total)
        _SCRATCH.buf = buf
    views: list[Tensor | None] = []
    offset = 0
    for shape, size in zip(shapes, sizes, strict=True):
        views.append(buf[offset : offset + size].view(tuple(shape)))
        offset += size
    return views


def _floored(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``clamp_min(log_softmax(x), LOG_FLOOR)`` in float32, *not* renormalized: ``(..., V)``.

    It differs from :func:`normalize` by a constant per row, which every rule that is invariant
    to a per-row shift (RPDs, CP-Δr, CP-ΔKL, a final ``log_softmax``) uses to skip the
    renormalization. ``x`` must be float32; the result is a new tensor, or ``out``.
    """
    if out is None:
        return torch.log_softmax(x, dim=-1).clamp_min_(LOG_FLOOR)
    return torch.log_softmax(x, dim=-1, out=out).clamp_min_(LOG_FLOOR)


def _floored_pair(
    x: Tensor, *, out_y: Tensor | None = None, out_p: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y - log_p_max, log_p_max, p)`` with ``y = _floored(x)``, ``p = exp(y)``, in one
    exponential pass.

    ``p = max(softmax(x), e^LOG_FLOOR)``; ``log_p_max = log max softmax(x) = -log sum exp(x - max
    x)`` ``(..., 1)``; and ``y - log_p_max = max(x - max x, LOG_FLOOR - log_p_max)``, the floored
    log-probs up to that per-row shift (which RPDs and a final ``log_softmax`` ignore). Faster
    per row than ``log_softmax`` plus ``softmax``. ``x`` float32; results are new tensors or
    ``out_y``/``out_p``.
    """
    p = torch.softmax(x, dim=-1) if out_p is None else torch.softmax(x, dim=-1, out=out_p)
    log_p_max = p.amax(dim=-1, keepdim=True).log_()  # (argmax is 15x slower than amax)
    x_max = x.amax(dim=-1, keepdim=True)
    y = torch.sub(x, x_max) if out_y is None else torch.sub(x, x_max, out=out_y)
    y.clamp_min_(LOG_FLOOR - log_p_max)
    return y, log_p_max, p.clamp_min_(_PROB_FLOOR)


def _normalized(x: Tensor, *, scratch: bool = False) -> Tensor:
    """:func:`normalize` without validation (``x`` float32); ``scratch``: the result is a scratch
    view (only for callers that reduce it to a new tensor before returning)."""
    (buf_p, *buf_y) = _scratch([x.shape, x.shape] if scratch else [x.shape], x)
    y, log_p_max, p = _floored_pair(x, out_y=buf_y[0] if scratch else None, out_p=buf_p)
    log_z = p.sum(dim=-1, keepdim=True).log_()  # >= 0: the floor's extra mass
    return y.add_(log_p_max.sub_(log_z))


def normalize(x: Tensor) -> Tensor:
    """Log-probabilities with the e^-20 floor of §2.1: ``Tensor[..., V]`` -> ``Tensor[..., V]``.

    ``log_softmax`` in float32, ``clamp_min(LOG_FLOOR)``, then renormalize: subtract
    ``log Z = logsumexp(clamped) = log sum_y max(softmax(x)(y), e^-20)``.
    Accepts logits or log-probabilities (any float dtype); returns float32.
    """
    return _normalized(_as_float32(x, "normalize: x"))


def rpd(logp: Tensor) -> Tensor:
    """Log relative probabilities (Def. 2.5, RPD): ``log rp = log p - log tp``, ``(..., V)``.

    ``log tp`` is the mean of ``log p`` over the vocabulary, so the result has mean 0 over the
    last dimension. ``logp`` (logits or log-probs) is floored first (:func:`normalize`).
    """
    y = _floored(_as_float32(logp, "rpd: logp"))
    return y.sub_(y.mean(dim=-1, keepdim=True))


def _block_size(vocab: int, m: int) -> int:
    """Block length for :func:`_top_m_indices`, or 0 to use a plain ``torch.topk``."""
    for blk in range(_TOPK_BLOCK, _TOPK_BLOCK // 4, -1):
        if vocab % blk == 0:
            return blk if m * blk * 4 <= vocab else 0
    return 0


def _top_m_indices(score: Tensor, m: int) -> Tensor:
    """Indices of the m largest entries of each row: ``(..., V)`` -> ``LongTensor[..., m]``.

    Same set as ``torch.topk(score, m).indices`` (up to ties, broken arbitrarily), but faster
    for m << V: the rows are cut into blocks, the m blocks with the largest maxima are kept (they
    must contain the top m: an entry outside them is beaten by the m block maxima), and the top
    m of those ``m * block`` candidates is taken.
    """
    vocab = score.shape[-1]
    blk = _block_size(vocab, m)
    if blk == 0:
        return torch.topk(score, m, dim=-1, sorted=False).indices
    lead = score.shape[:-1]
    blocks = score.reshape(-1, vocab // blk, blk)  # (R, nb, blk)
    top_blocks = torch.topk(blocks.amax(dim=-1), m, dim=-1, sorted=False).indices  # (R, m)
    cand = blocks.gather(1, top_blocks.unsqueeze(-1).expand(-1, m, blk))  # (R, m, blk)
    j = torch.topk(cand.reshape(-1, m * blk), m, dim=-1, sorted=False).indices  # (R, m)
    idx = top_blocks.gather(1, j.div(blk, rounding_mode="floor")).mul_(blk).add_(j % blk)
    return idx.reshape(*lead, m)


class _Smoothing(NamedTuple):
    """The pieces of S_m (§4.1) for K constituents; see :func:`_smoothing`."""

    y_base: Tensor  # (*batch, V) or broadcastable: floored base log-probs (shifted per row)
    mu_base: Tensor  # (..., 1): mean of y_base, so lr_base = y_base - mu_base
    d: Tensor  # (K, *batch, V): log rp_i - log rb
    idx: Tensor  # (K, *batch, m): kept tokens
    d_top: Tensor  # (K, *batch, m): d at the kept tokens
    c: Tensor  # (K, *batch, 1): sum(d_top) / V, so S_m(rp_i, rb) = lr_base + d [kept] - c


def _smoothing(x: Tensor, base: Tensor, m: int) -> _Smoothing:
    """S_m (§4.1) of K float32 constituents ``x`` ``(K, *batch, V)`` against float32 ``base``.

    ``S_m(rp, rb)(y) = beta rp(y)`` on the m tokens of largest ``score = p log(rp/rb)`` and
    ``beta rb(y)`` elsewhere, with ``log beta = -c`` so that the mean log is 0. ``p`` is the
    floored constituent; its normalizing constant does not change the order of the scores, so
    ``exp(_floored(x)) * d`` ranks the tokens.
    """
    vocab = x.shape[-1]
    buf_y, buf_p, buf_b = _scratch([x.shape, x.shape, base.shape], x, base)
    y, _, p = _floored_pair(x, out_y=buf_y, out_p=buf_p)  # (K, *batch, V), y up to a shift
    y_base = _floored(base, out=buf_b)  # base's own shape
    mu_base = y_base.mean(dim=-1, keepdim=True)
    shift = y.mean(dim=-1, keepdim=True).sub_(mu_base)  # (K, *batch, 1): log tp - log tb
    d = y.sub_(y_base).sub_(shift)  # (K, *batch, V), in place: log rp - log rb
    score = p.mul_(d)  # (K, *batch, V), in place
    idx = _top_m_indices(score, m)  # (K, *batch, m)
    d_top = d.gather(-1, idx)  # (K, *batch, m)
    c = d_top.sum(dim=-1, keepdim=True).div_(vocab)  # (K, *batch, 1)
    return _Smoothing(y_base, mu_base, d, idx, d_top, c)


def _checked_smoothing(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int, method: str, *, min_k: int = 1
) -> tuple[Tensor, _Smoothing]:
    x = _check_logps(logps, method, min_k=min_k)
    b = _check_base(base, x, method)
    m = _check_m(m, x.shape[-1], method)
    return x, _smoothing(x, b, m)


def _dense(sm: _Smoothing, *, reuse_d: bool = False) -> Tensor:
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
    return _dense(_checked_smoothing(logps, base, m, method, min_k=min_k)[1])


def smoothed_rpds(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int = DEFAULT_M
) -> Tensor:
    """Smoothed RPDs ``log S_m(rp_i, rb)`` (§4.1) of K constituents: ``Tensor[K, *batch, V]``.

    ``S_m(rp, rb)(y) = beta rp(y)`` on the m tokens of largest ``p(y) log(rp(y)/rb(y))`` and
    ``beta rb(y)`` elsewhere, with ``beta`` chosen so that the mean log is 0.
    """
    return _smoothed(logps, base, m, "smoothed_rpds")


def smooth(logp: Tensor, log_base: Tensor, m: int = DEFAULT_M) -> Tensor:
    """``log S_m(rp, rb)`` (§4.1) of one distribution: ``Tensor[*batch, V]`` (mean log 0).

    Args:
        logp: ``(*batch, V)`` logits or log-probs of p (floored first).
        log_base: ``(*batch, V)`` or ``(V,)`` logits or log-probs of the base b (floored first).
        m: number of tokens that keep p's relative probability (1 <= m < V).
    """
    logp = _as_float32(logp, "smooth: logp")
    return _smoothed(logp.unsqueeze(0), log_base, m, "smooth")[0]


def kept_tokens(logp: Tensor, log_base: Tensor, m: int = DEFAULT_M) -> Tensor:
    """The m tokens S_m keeps unsmoothed (§4.1): ``LongTensor[*batch, m]`` (unordered).

    The top-m of ``score(y) = p(y) log(rp(y)/rb(y))`` — the same choice :func:`smooth` makes.
    """
    x = _check_logps(_as_float32(logp, "kept_tokens: logp").unsqueeze(0), "kept_tokens", min_k=1)
    b = _check_base(log_base, x, "kept_tokens")
    m = _check_m(m, x.shape[-1], "kept_tokens")
    return _smoothing(x, b, m).idx[0]


def smoothed_logps(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int = DEFAULT_M
) -> Tensor:
    """The distributions ``p~_i`` induced by the smoothed RPDs (Alg. 1): ``Tensor[K, *batch, V]``.

    ``log p~_i = log S_m(rp_i, rb) - logsumexp(log S_m(rp_i, rb))`` (normalized log-probs). SCP-Δr
    is CP-Δr of these, so its NAF bound is computed on them (``scpdr.bounds``).
    """
    return torch.log_softmax(_smoothed(logps, base, m, "smoothed_logps"), dim=-1)


# --------------------------------------------------------------------------------------------
# aggregation rules


def none(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """No aggregation: constituent 0, floored and normalized (the "No CP" rows). K >= 1."""
    x = _check_logps(logps, "none", min_k=1)
    return _normalized(x[0])


def cp_delta(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-Δ (Def. 2.2) for K >= 2: ``r(y) = min_i p_i(y) / Z``, ``Z = sum_y min_i p_i(y)``.

    NAF-tight under the max divergence with ``k_x = D_m(p, q)`` for K = 2 (Thm. 2.3, ``thm:cp_d``).
    ``base`` and ``m`` are ignored. Returns ``log r``: ``Tensor[*batch, V]``.
    """
    x = _check_logps(logps, "cp-delta", min_k=2)
    return torch.log_softmax(_normalized(x, scratch=True).amin(dim=0), dim=-1)


def cp_kl(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-ΔKL (§2.5, Vyas et al. 2023): the normalized geometric mean of the constituents.

    ``r(y) ∝ (prod_i p_i(y))^(1/K)``, which minimizes ``sum_i KL(r || p_i)``. Returns
    ``log r``: ``Tensor[*batch, V]``. ``base`` and ``m`` are ignored.
    """
    x = _check_logps(logps, "cp-kl", min_k=2)
    y = _floored(x, out=_scratch([x.shape], x)[0])  # (K, *batch, V)
    return torch.log_softmax(y.mean(dim=0), dim=-1)


def cp_delta_r(
    logps: Tensor | Sequence[Tensor], *, base: Tensor | None = None, m: int = DEFAULT_M
) -> Tensor:
    """CP-Δr (Def. 2.6): ``r(y) = min_i rp_i(y) / Z`` over the RPDs (Def. 2.5), K >= 2.

    NAF-tight under the relative max divergence with ``k_x = D_r(p, q)`` for K = 2 (Thm. 2.7,
    ``thm:cp_dr``). Returns ``log r``: ``Tensor[*batch, V]``. ``base`` and ``m`` are ignored.
    """
    x = _check_logps(logps, "cp-delta-r", min_k=2)
    y = _floored(x, out=_scratch([x.shape], x)[0])  # (K, *batch, V)
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
        m: tokens kept unsmoothed per constituent (1 <= m < V).

    Returns ``log r``: ``Tensor[*batch, V]``.

    On CPU without autograd a fused C kernel computes the same thing (``scpdr._kernel``; built
    on first use, ``SCPDR_NAF_KERNEL=0`` turns it off); elsewhere, the torch implementation.
    """
    x = _check_logps(logps, "scp-delta-r", min_k=2)  # float32 from here on: no second copy
    b = _check_base(base, x, "scp-delta-r")
    m = _check_m(m, x.shape[-1], "scp-delta-r")
    fused = _scp_delta_r_fused(x, b, m)
    if fused is not None:
        return fused
    return _scp_delta_r(x, b, m, components=False)[0]


def _scp_delta_r_fused(x: Tensor, b: Tensor, m: int) -> Tensor | None:
    """SCP-Δr with the fused CPU kernel (:mod:`scpdr._kernel`) of validated float32 ``x``
    ``(K, *batch, V)`` and base ``b``, or None where it does not apply (another device, autograd,
    K or m beyond its limits, or no kernel on this machine)."""
    from scpdr import _kernel

    if x.device.type != "cpu" or b.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and (x.requires_grad or b.requires_grad):
        return None
    if x.shape[0] > _kernel.MAX_K or m > _kernel.MAX_M:
        return None
    fn = _kernel.scp_delta_r_kernel()
    if fn is None:
        return None
    k, shape, vocab = x.shape[0], tuple(x.shape[1:]), x.shape[-1]
    n = math.prod(shape[:-1])
    xc = x.reshape(k, n, vocab).contiguous()
    if b.numel() == vocab:  # a constant base ('c' variant)
        bc, rows = b.reshape(1, vocab).contiguous(), 1
    else:
        bc, rows = b.expand(shape).reshape(n, vocab).contiguous(), n
    out = torch.empty((n, vocab), dtype=torch.float32)
    if fn(xc.data_ptr(), k, n, vocab, bc.data_ptr(), rows, m, out.data_ptr()) != 0:
        return None
    return out.reshape(shape)


def _scp_delta_r(
    logps: Tensor | Sequence[Tensor], base: Tensor | None, m: int, *, components: bool
) -> tuple[Tensor, Tensor | None]:
    """SCP-Δr and optionally its smoothed components, over chunks of the batch.

    Chunks of at most :data:`SCP_CHUNK_ELEMENTS` constituent elements bound the intermediates
    (so they fit the scratch buffer at any batch size). Every row is computed the same way
    whatever the chunking.
    """
    x = _check_logps(logps, "scp-delta-r", min_k=2)
    b = _check_base(base, x, "scp-delta-r")
    m = _check_m(m, x.shape[-1], "scp-delta-r")
    k, shape, vocab = x.shape[0], tuple(x.shape[1:]), x.shape[-1]
    n = math.prod(shape[:-1])
    rows = max(1, SCP_CHUNK_ELEMENTS // (k * vocab))
    if n <= rows and not components:  # one chunk: skip the bookkeeping (it shows at batch 1)
        return _scp_delta_r_sparse(_smoothing(x, b, m), shape), None
    xf = x.reshape(k, n, vocab)  # (K, N, V)
    bf = b.reshape(vocab) if b.numel() == vocab else b.expand(shape).reshape(n, vocab)
    out = torch.empty((n, vocab), device=x.device)
    comps = torch.empty((k, n, vocab), device=x.device) if components else None
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        sm = _smoothing(xf[:, start:stop], bf if bf.ndim == 1 else bf[start:stop], m)
        if comps is not None:
            torch.log_softmax(_dense(sm), dim=-1, out=comps[:, start:stop])
        _scp_delta_r_sparse(sm, (stop - start, vocab), out=out[start:stop])
    return out.reshape(shape), None if comps is None else comps.reshape(k, *shape)


def _scp_delta_r_sparse(
    sm: _Smoothing, shape: tuple[int, ...], *, out: Tensor | None = None
) -> Tensor:
    """SCP-Δr from the smoothing pieces (see :func:`scp_delta_r`); ``shape = (*batch, V)``.

    Consumes ``sm.y_base`` (modified in place when it has the full shape).
    """
    k, m = sm.idx.shape[0], sm.idx.shape[-1]
    union = sm.idx.movedim(0, -2).reshape(*shape[:-1], k * m)  # (*batch, K*m), with duplicates
    d_union = sm.d.gather(-1, union.unsqueeze(0).expand(k, *union.shape))  # (K, *batch, K*m)
    kept = (union.unsqueeze(0).unsqueeze(-1) == sm.idx.unsqueeze(-2)).any(dim=-1)  # same
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
    _, sm = _checked_smoothing(logps, base, m, "scp-delta", min_k=2)
    s = _dense(sm, reuse_d=True)  # (K, *batch, V)
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
    as the aggregate. The aggregate is bit-identical to :func:`aggregate`'s torch path; for
    SCP-Δr, :func:`aggregate` on CPU uses the fused kernel, which agrees to float rounding
    (~1e-5), so callers that certify the served distribution take both from here.
    """
    fn = _lookup(method)
    if method not in SCP_METHODS:
        k_min = 1 if method == "none" else 2
        comps = _normalized(_check_logps(logps, method, min_k=k_min))
        return fn(logps, base=base, m=m), comps
    if method == "scp-delta-r":
        log_r, comps = _scp_delta_r(logps, base, m, components=True)
        assert comps is not None
        return log_r, comps
    _, sm = _checked_smoothing(logps, base, m, method, min_k=2)
    comps = torch.log_softmax(_dense(sm), dim=-1)  # (K, *batch, V)
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


# --------------------------------------------------------------------------------------------
# CP-Fuse


def _as_grid(grid: Tensor | Sequence[Sequence[float]] | None) -> Tensor:
    if isinstance(grid, Tensor):
        g = grid.detach().to(torch.float32)
    else:
        g = torch.tensor(CP_FUSE_GRID if grid is None else grid, dtype=torch.float32)
    if g.ndim != 2 or g.shape[1] != 2 or g.shape[0] < 1:
        raise ValueError(
            f"cp_fuse_step: grid must have shape (G, 2) of weight pairs (b1, b2), got "
            f"{tuple(g.shape)}"
        )
    if not torch.isfinite(g).all() or (g < 0).any() or (g.sum(dim=1) <= 0).any():
        raise ValueError(
            "cp_fuse_step: grid weights must be finite and >= 0, and no pair may be (0, 0)"
        )
    return g


def cp_fuse_step(
    logps: Tensor | Sequence[Tensor],
    path_logprobs: Tensor | float,
    *,
    grid: Tensor | Sequence[Sequence[float]] | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoding step of CP-Fuse (Abad et al. 2025) for K = 2.

    Chooses ``(b1, b2)`` on ``grid`` (default :data:`CP_FUSE_GRID`) minimizing, per batch row,
    ``max_i KL(r || p_i) - path_logprob_i`` with ``log r = b1 log p1 + b2 log p2 - A(b)``, where
    ``path_logprob_i = log p_i(prefix generated so far)`` (0 at the first step, where this is
    the path-free objective). Uses ``KL(r||p_i) = b1 E_r[log p1] + b2 E_r[log p2] - A - E_r[log
    p_i]``; the grid is evaluated in chunks of at most :data:`CP_FUSE_CHUNK_ELEMENTS` elements
    with a running argmin (the first grid point wins ties).

    Args:
        logps: ``(2, *batch, V)`` logits or log-probs of the two constituents (floored first).
        path_logprobs: ``(2, *batch)`` (or broadcastable, e.g. ``0.0``) prefix log-probs.
        grid: ``(G, 2)`` non-negative weight pairs, no ``(0, 0)``.

    Returns ``(log_r, weights)``: ``Tensor[*batch, V]`` normalized log-probs and the chosen
    ``Tensor[*batch, 2]`` weights.
    """
    x = _check_logps(logps, "cp-fuse", min_k=2)
    if x.shape[0] != 2:
        raise ValueError(f"cp_fuse_step fuses exactly K = 2 constituents, got K = {x.shape[0]}")
    batch, vocab = tuple(x.shape[1:-1]), x.shape[-1]
    path = torch.as_tensor(path_logprobs, dtype=torch.float32, device=x.device)
    try:
        path = path.expand((2, *batch))
    except RuntimeError:
        raise ValueError(
            f"cp_fuse_step: path_logprobs shape {tuple(path.shape)} does not broadcast to "
            f"(2, *batch) = {(2, *batch)}"
        ) from None
    g = _as_grid(grid).to(x.device)  # (G, 2)
    lp = _normalized(x).reshape(2, -1, vocab)  # (2, B, V)
    path_b = path.reshape(2, -1).t().unsqueeze(1)  # (B, 1, 2)
    nb = lp.shape[1]
    lpb = lp.transpose(0, 1).contiguous()  # (B, 2, V)
    lpt = lpb.transpose(1, 2)  # (B, V, 2)
    chunk = min(g.shape[0], max(1, CP_FUSE_CHUNK_ELEMENTS // max(1, nb * vocab)))
    (buf,) = _scratch([(nb * chunk * vocab,)], x)
    if buf is None:
        buf = torch.empty(nb * chunk * vocab, device=x.device)
    best_obj = torch.full((nb,), math.inf, device=x.device)
    best_idx = torch.zeros((nb,), dtype=torch.long, device=x.device)
    for start in range(0, g.shape[0], chunk):
        w = g[start : start + chunk]  # (n, 2)
        z = buf[: nb * w.shape[0] * vocab].view(nb, w.shape[0], vocab)  # (B, n, V)
        torch.matmul(w, lpb, out=z)  # b1 log p1 + b2 log p2
        z_max = z.amax(dim=-1, keepdim=True)  # (B, n, 1)
        r = z.sub_(z_max).exp_()  # (B, n, V): r times its normalizer, in place
        total = r.sum(dim=-1)  # (B, n)
        a = total.log() + z_max.squeeze(-1)  # (B, n): log normalizer A(b)
        e = torch.bmm(r, lpt).div_(total.unsqueeze(-1))  # (B, n, 2): E_r[log p_k]
        cross = (e * w).sum(dim=-1) - a  # (B, n): sum_y r log r
        obj = (cross.unsqueeze(-1) - e - path_b).amax(dim=-1)  # (B, n)
        val, arg = obj.min(dim=1)  # (B,)
        better = val < best_obj
        best_obj = torch.where(better, val, best_obj)
        best_idx = torch.where(better, arg + start, best_idx)
    weights = g[best_idx]  # (B, 2)
    z = weights[:, 0:1] * lp[0] + weights[:, 1:2] * lp[1]  # (B, V)
    log_r = torch.log_softmax(z, dim=-1)
    return log_r.reshape(*batch, vocab), weights.reshape(*batch, 2)
