"""The fused SCP-Δr kernel (``scp_delta_r.c``; Alg. 1 on the smoothed RPDs of §4.1).

On CPU the torch implementation (:func:`scpdr.naf.scp_delta_r_torch`) makes ~65 small ATen
calls and writes ~9 MB of intermediates at batch 8, which right after a decode step costs
1.5–3% of the step (``docs/performance.md``); the kernel does one row at a time in a few
vectorized passes over data that stays in L2 and writes only the output, the rows split over
torch's threads where a batch is large enough (an OpenMP build: a teacher-forced ``score`` of
8 × 32 tokens aggregates in ~50 ms on two threads instead of ~100 ms on one). It equals the
definition to float rounding (``tests/test_kernel.py``) and keeps the same S_m kept set on
exact ties (score, then token id).

:func:`run` calls the kernel on validated float32 tensors; :func:`chosen` says whether to, for
the inputs at hand: the kernel must apply (CPU, no autograd, K ≤ :data:`MAX_K`, m ≤
:data:`MAX_M`), build here, and be the faster of the two on this shape class
(:func:`scpdr.kernels.build.choose`; measured on the first call, remembered).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import torch
from torch import Tensor

from scpdr.kernels import build

__all__ = ["MAX_K", "MAX_M", "NAME", "SMALL_ELEMENTS", "applies", "chosen", "library", "run"]

#: The kernel's name (its C source, its environment switch in :data:`build.SWITCHES`).
NAME = "scp_delta_r"
#: Limits of the kernel (larger K or m use the torch implementation).
MAX_K = 16
MAX_M = 64
#: Up to this many constituent elements (K x rows x V) the kernel is used without measuring:
#: there the torch path's ~65 ATen calls (~0.2 ms of dispatch) cost more than the kernel's
#: whole work (measured in docs/performance.md), and timing each of the many small shapes the
#: tests draw would cost more than it could save.
SMALL_ELEMENTS = 1 << 16
_TITLE = "SCP-Δr kernel"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _configure(lib: ctypes.CDLL) -> str:
    fn = lib.scp_delta_r_f32
    fn.restype = ctypes.c_int
    # x (K, N, V), K, N, V, base (base_rows, V), base_rows (1: a constant base, or N), m,
    # out (N, V), kept (K, N, m) or NULL, threads; float32 / int64, contiguous
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64]
    for name in ("scpdr_scp_max_k", "scpdr_scp_max_m"):
        getattr(lib, name).restype = _I64
    if (lib.scpdr_scp_max_k(), lib.scpdr_scp_max_m()) != (MAX_K, MAX_M):
        raise RuntimeError("scp_delta_r.c and scpdr.kernels.scp disagree on MAX_K/MAX_M")
    lib.scpdr_scp_isa.restype = ctypes.c_char_p
    return lib.scpdr_scp_isa().decode()


def library(target: str | None = None) -> build.Library | None:
    """The ``scp_delta_r`` build for ``target`` (default :func:`build.default_target`), or None
    when it cannot be built here (a warning, once)."""
    return build.load(
        NAME,
        what="SCP-Δr: the fused CPU kernel",
        configure=_configure,
        target=target,
        openmp=True,
    )


def applies(x: Tensor, base: Tensor, m: int) -> bool:
    """Whether the kernel can compute SCP-Δr of float32 ``x`` ``(K, *batch, V)`` and ``base``
    with this ``m``: both on CPU, no autograd graph to build, K ≤ :data:`MAX_K`, m ≤
    :data:`MAX_M`."""
    if x.device.type != "cpu" or base.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (x.requires_grad or base.requires_grad):
        return False
    return x.shape[0] <= MAX_K and 1 <= m <= MAX_M and m < x.shape[-1]


def run(
    lib: build.Library,
    x: Tensor,
    base: Tensor,
    m: int,
    *,
    kept: bool = False,
    threads: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """SCP-Δr by the kernel: normalized log-probs ``(*batch, V)`` of float32 ``x`` ``(K,
    *batch, V)`` and ``base`` (``(*batch, V)``, anything broadcasting to it, or ``(V,)``);
    with ``kept``, also S_m's kept tokens ``LongTensor[K, *batch, m]`` (by decreasing score,
    ties to the smaller id). The inputs must satisfy :func:`applies`. The rows are split over
    ``threads`` threads (default torch's; an OpenMP build only, and only batches of more than
    ~64k constituent elements): each row is computed by one thread, so the result is the same
    for any thread count."""
    # A contiguous (K, *batch, V) tensor is the kernel's (K, N, V) layout as it is
    # (``contiguous()`` returns it), and the output is made in its final shape: few torch calls,
    # as right after a decode step each runs from cold caches (tens of microseconds), a large
    # share of the aggregation at B = 1.
    k, shape, vocab = x.shape[0], x.shape[1:], x.shape[-1]
    n = math.prod(shape[:-1])
    xc = x.contiguous()
    if base.numel() == vocab:  # a constant base ('c' variant)
        bc, rows = base.contiguous(), 1
    else:
        bc, rows = (base if base.shape == shape else base.expand(shape)).contiguous(), n
    out = torch.empty(shape, dtype=torch.float32)
    idx = torch.empty((k, *shape[:-1], m), dtype=torch.int64) if kept else None
    rc = lib.cdll.scp_delta_r_f32(
        xc.data_ptr(), k, n, vocab, bc.data_ptr(), rows, m, out.data_ptr(),
        None if idx is None else idx.data_ptr(),
        torch.get_num_threads() if threads is None else threads,
    )  # fmt: skip
    if rc == -2:
        raise MemoryError("scp_delta_r_f32: out of memory")
    if rc != 0:
        raise ValueError(f"scp_delta_r_f32 does not take K = {k}, m = {m}, V = {vocab}")
    return out if idx is None else (out, idx)


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two (shape classes share a decision)."""
    return 1 << max(0, (n - 1).bit_length())


def chosen(
    x: Tensor, base: Tensor, m: int, torch_impl: Callable[[], Tensor]
) -> build.Library | None:
    """The library to compute SCP-Δr of these validated float32 inputs with, or None for
    torch: the kernel applies (:func:`applies`), builds here, and is forced on or measured
    faster than ``torch_impl`` (the same computation in torch) on this shape class (K, rows
    and V rounded up to powers of two, m, base per row or constant). Inputs of at most
    :data:`SMALL_ELEMENTS` constituent elements take the kernel without measuring."""
    if not applies(x, base, m):
        return None
    side = build.policy(NAME)
    if side == "torch":
        return None
    lib = library()
    if lib is None or side == "kernel" or x.numel() <= SMALL_ELEMENTS:
        return lib
    k, vocab = x.shape[0], x.shape[-1]
    n = x.numel() // (k * vocab)
    constant = base.numel() == vocab
    shape = f"K{k}-rows{_bucket(n)}-V{_bucket(vocab)}-m{m}-{'constant' if constant else 'row'}"

    def measure() -> list[tuple[str, float, float]]:
        med = build.interleaved_medians(
            {"kernel": lambda: run(lib, x, base, m), "torch": torch_impl}, repeats=5
        )
        return [(f"at K = {k}, {n} rows, V = {vocab}, m = {m}", med["kernel"], med["torch"])]

    return lib if build.choose(lib, shape, measure, title=_TITLE, side=side).use_kernel else None
