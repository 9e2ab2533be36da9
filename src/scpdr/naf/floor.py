"""The e^-20 probability floor of §2.1, RPDs (Def. 2.5), and the scratch buffer the rules use.

Speed notes (``benchmarks/bench_naf.py``): on CPU the fused ``log_softmax``/``softmax`` kernels
are faster than ``torch.exp``/``torch.logsumexp`` on the same data, and every fresh tensor of a
few hundred KiB costs page faults, so the code below uses the fused kernels, works in place on
tensors it created, and never concatenates.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from scpdr.naf.checks import LOG_FLOOR, as_float32

__all__ = [
    "PROB_FLOOR",
    "SCRATCH_MAX_BYTES",
    "floored",
    "floored_pair",
    "normalize",
    "normalized",
    "rpd",
    "scratch",
    "scratch_buffer",
]

#: The floor itself, e^LOG_FLOOR.
PROB_FLOOR = math.exp(LOG_FLOOR)
#: On CPU, the rules' large intermediates (never their outputs) live in one cached per-thread
#: buffer of at most this many bytes; see :func:`scratch`.
SCRATCH_MAX_BYTES = 64 << 20


class _ScratchCache(threading.local):
    buf: Tensor | None = None


_SCRATCH = _ScratchCache()


def scratch_buffer() -> Tensor | None:
    """This thread's scratch buffer (None before the first use): the memory no rule's output
    may alias (for tests and diagnostics)."""
    return _SCRATCH.buf


def scratch(shapes: Sequence[Sequence[int]], *like: Tensor) -> list[Tensor | None]:
    """``out=`` tensors of ``shapes`` (float32) for intermediates that never leave the rules.

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


def floored(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``clamp_min(log_softmax(x), LOG_FLOOR)`` in float32, *not* renormalized: ``(..., V)``.

    It differs from :func:`normalize` by a constant per row, which every rule that is invariant
    to a per-row shift (RPDs, CP-Δr, CP-ΔKL, a final ``log_softmax``) uses to skip the
    renormalization. ``x`` must be float32; the result is a new tensor, or ``out``.
    """
    if out is None:
        return torch.log_softmax(x, dim=-1).clamp_min_(LOG_FLOOR)
    return torch.log_softmax(x, dim=-1, out=out).clamp_min_(LOG_FLOOR)


def floored_pair(
    x: Tensor, *, out_y: Tensor | None = None, out_p: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y - log_p_max, log_p_max, p)`` with ``y = floored(x)``, ``p = exp(y)``, in one
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
    return y, log_p_max, p.clamp_min_(PROB_FLOOR)


def normalized(x: Tensor, *, use_scratch: bool = False) -> Tensor:
    """:func:`normalize` without validation (``x`` float32); ``use_scratch``: the result is a
    scratch view (only for callers that reduce it to a new tensor before returning)."""
    (buf_p, *buf_y) = scratch([x.shape, x.shape] if use_scratch else [x.shape], x)
    y, log_p_max, p = floored_pair(x, out_y=buf_y[0] if use_scratch else None, out_p=buf_p)
    log_z = p.sum(dim=-1, keepdim=True).log_()  # >= 0: the floor's extra mass
    return y.add_(log_p_max.sub_(log_z))


def normalize(x: Tensor) -> Tensor:
    """Log-probabilities with the e^-20 floor of §2.1: ``Tensor[..., V]`` -> ``Tensor[..., V]``.

    ``log_softmax`` in float32, ``clamp_min(LOG_FLOOR)``, then renormalize: subtract
    ``log Z = logsumexp(clamped) = log sum_y max(softmax(x)(y), e^-20)``.
    Accepts logits or log-probabilities (any float dtype); returns float32.
    """
    return normalized(as_float32(x, "normalize: x"))


def rpd(logp: Tensor) -> Tensor:
    """Log relative probabilities (Def. 2.5, RPD): ``log rp = log p - log tp``, ``(..., V)``.

    ``log tp`` is the mean of ``log p`` over the vocabulary, so the result has mean 0 over the
    last dimension. ``logp`` (logits or log-probs) is floored first (:func:`normalize`).
    """
    y = floored(as_float32(logp, "rpd: logp"))
    return y.sub_(y.mean(dim=-1, keepdim=True))
