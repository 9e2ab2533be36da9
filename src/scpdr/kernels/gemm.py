"""The packed GEMM kernel (``packed_gemm.c``) and its weight layout, for the shared-base LoRA
fast path (:mod:`scpdr.lora.layers`, ``docs/lora_fast_path.md``).

A weight ``W (n, k)`` of ``y = x·Wᵀ`` is stored as panels of ``width`` output columns
(:func:`pack_panels`), ``width`` being the tile width the library was built with for its ISA
(:attr:`GemmLibrary.panel_width`: 32 with AVX-512, 24 with AVX2, 16 with NEON). One call of
:func:`lora_linear` computes a stacked linear — the base matmul of every row plus the LoRA
deltas of the first L groups — and :func:`lora_linear_reference` computes the same in torch
ops on the same layout (differentiable: the slow reference of the tests, and the path for
inputs the kernel does not take).

The base weight's panels are float32, or bfloat16 (``pack_panels(..., dtype=torch.bfloat16)``:
half the bytes streamed per decoding step; the kernel widens them to float32 exactly in
registers, and the rows, products and sums stay float32, in the same order, so the result
equals the float32 kernel's on the bf16-rounded weight bit for bit). A bf16 panel pairs the
weights of two consecutive inputs of each column: ``(ceil(k / 2), width, 2)``, the last pair
zero-padded for an odd k. A base loaded from a GGUF file may also keep its Q4_1 blocks
(:mod:`scpdr.kernels.q4`: uint8 panels, ~3/16 of the float32 bytes; the kernel rebuilds the
loader's float32 values exactly, so the result equals the float32 kernel's bit for bit). The
LoRA matrices stay float32.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from scpdr.kernels import build
from scpdr.kernels.q4 import is_q4_panels, q4_panel_floats, unpack_q4_panels

__all__ = [
    "NAME",
    "PANEL_DTYPES",
    "GemmLibrary",
    "LinearCall",
    "library",
    "linear_call",
    "lora_linear",
    "lora_linear_reference",
    "lora_linear_torch",
    "pack_panels",
    "panel_floats",
    "unpack_panels",
]

#: The kernel's name (its C source, its environment switch in :data:`build.SWITCHES`).
NAME = "packed_gemm"
#: ISAs with a register tile; any other build ("generic") is never used.
TILED_ISAS = frozenset({"avx512", "avx2", "neon"})
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class GemmLibrary:
    """A loaded ``packed_gemm`` build: its :class:`build.Library`, the panel width its weights
    are packed with and the rows of its register tile."""

    lib: build.Library
    panel_width: int
    tile_rows: int

    @property
    def tiled(self) -> bool:
        """Whether the build has a register tile for its ISA (else torch is used)."""
        return self.lib.isa in TILED_ISAS

    @property
    def prefetch(self) -> bool:
        """Whether a panel's tiles after the first prefetch the next panel into L2 (on when
        loaded; :func:`scpdr.lora.gemm_choice.choose_gemm` keeps it only where faster)."""
        return bool(self.lib.cdll.scpdr_gemm_prefetch())

    def set_prefetch(self, on: bool) -> None:
        """Turn the next-panel prefetch on or off for every caller of this build."""
        self.lib.cdll.scpdr_gemm_set_prefetch(1 if on else 0)


def _configure(lib: ctypes.CDLL) -> str:
    gemm = lib.scpdr_gemm_packed_f32
    # m, n, k, x, ldx, packed w, y, ldy, accumulate, threads
    gemm.argtypes = [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, ctypes.c_int, _I64]
    gemm.restype = None
    lora = lib.scpdr_lora_linear_f32
    # g, rows, n, k, x, packed w, l, r, packed a, packed b, tmp, y, threads
    lora.argtypes = [_I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64]
    lora.restype = None
    for fn, args in ((lib.scpdr_gemm_packed_bf16w, gemm.argtypes),
                     (lib.scpdr_lora_linear_bf16w, lora.argtypes),
                     (lib.scpdr_gemm_packed_q4w, gemm.argtypes),
                     (lib.scpdr_lora_linear_q4w, lora.argtypes)):  # fmt: skip
        fn.argtypes, fn.restype = args, None
    for fn in (lib.scpdr_panel_width, lib.scpdr_tile_rows):
        fn.argtypes, fn.restype = [], _I64
    lib.scpdr_gemm_isa.argtypes, lib.scpdr_gemm_isa.restype = [], ctypes.c_char_p
    lib.scpdr_gemm_set_prefetch.argtypes, lib.scpdr_gemm_set_prefetch.restype = [ctypes.c_int], None
    lib.scpdr_gemm_prefetch.argtypes, lib.scpdr_gemm_prefetch.restype = [], ctypes.c_int
    return lib.scpdr_gemm_isa().decode()


_WRAPPED: dict[int, GemmLibrary] = {}


def library(target: str | None = None) -> GemmLibrary | None:
    """The ``packed_gemm`` build for ``target`` (default :func:`build.default_target`), or None
    when it cannot be built here (a warning, once). Whether to *use* it is decided by the
    caller (:func:`build.choose`); a build without a tile for its ISA (``not .tiled``) never is.
    """
    lib = build.load(
        NAME,
        what="LoRA fast path: the packed CPU matmul kernel",
        configure=_configure,
        target=target,
        openmp=True,
    )
    if lib is None:
        return None
    found = _WRAPPED.get(id(lib))  # per layer and step: a dict lookup
    if found is None or found.lib is not lib:
        found = GemmLibrary(lib, int(lib.cdll.scpdr_panel_width()), int(lib.cdll.scpdr_tile_rows()))
        _WRAPPED[id(lib)] = found
    return found


#: The dtypes a packed base weight may have (uint8: q4 panels, :mod:`scpdr.kernels.q4`).
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
#: The kernel's stacked-linear entry point per panel dtype.
_ENTRIES = {
    torch.float32: "scpdr_lora_linear_f32",
    torch.bfloat16: "scpdr_lora_linear_bf16w",
    torch.uint8: "scpdr_lora_linear_q4w",
}


def pack_panels(
    w: Tensor, width: int, *, out: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``W (n, k)`` of ``y = x·Wᵀ`` laid out for the packed kernel: float32 panels
    ``(ceil(n / width), k, width)``, panel p holding ``W[p·width : (p + 1)·width]ᵀ`` (columns
    past n are zero, which adds exact zeros). Written without an intermediate padded copy,
    into ``out`` when given (zero-filled, at least that many panels; the panels past n are
    left). With ``dtype=torch.bfloat16`` (the base weight only; not with ``out``): W rounded to
    bf16 (to nearest even), each panel ``(ceil(k / 2), width, 2)`` (inputs 2i and 2i + 1 of a
    column side by side; a zero pads an odd k)."""
    if dtype not in PANEL_DTYPES[:2]:
        raise ValueError(
            f"packed panels are float32 or bfloat16, not {dtype} (q4 panels: q4.pack_q4_panels)"
        )
    n, k = w.shape
    full, rest = divmod(n, width)
    if dtype == torch.bfloat16:
        if out is not None:
            raise ValueError("bf16 panels are made whole (no out=)")
        f32 = pack_panels(w, width)  # (p, k, width)
        pad = torch.zeros(f32.shape[0], k + (k % 2), width, dtype=torch.bfloat16)
        pad[:, :k].copy_(f32)
        return pad.view(f32.shape[0], (k + 1) // 2, 2, width).transpose(2, 3).contiguous()
    if out is None:
        out = torch.zeros(full + (rest > 0), k, width, dtype=torch.float32)
    w = w.detach()
    if full:
        out[:full].copy_(w[: full * width].view(full, width, k).transpose(1, 2))
    if rest:
        out[full, :, :rest].copy_(w[full * width :].t())
    return out


def unpack_panels(packed: Tensor, n: int, k: int | None = None) -> Tensor:
    """The inverse of :func:`pack_panels`: ``W (n, k)`` (a copy, in the panels' dtype; float32
    for q4 panels). For bf16 panels (4 dimensions) ``k`` is needed when it may be odd (default:
    even)."""
    if is_q4_panels(packed):
        return unpack_q4_panels(packed, n)
    packed = _unpaired(packed, k)
    p, k2, width = packed.shape
    return packed.transpose(1, 2).reshape(p * width, k2)[:n]


def _unpaired(packed: Tensor, k: int | None) -> Tensor:
    """Float32 or bf16 panels as ``(p, k, width)`` in their dtype (bf16 ones, ``(p, ceil(k /
    2), width, 2)``, with their input pairs laid out again; ``k`` drops an odd k's padding)."""
    if packed.dim() == 4:
        p, half, width, _ = packed.shape
        packed = packed.transpose(2, 3).reshape(p, 2 * half, width)
        if k is not None:
            packed = packed[:, :k]
    return packed


@dataclass(frozen=True)
class LinearCall:
    """The arguments of one stacked linear's kernel call that stay the same from one decoding
    step to the next (shapes, groups, the kernel entry point), made once per input shape by
    :func:`linear_call`. A decoding step of the 135M model makes ~210 of these calls: the
    per-call Python of :func:`lora_linear` (keyword arguments, views, checks) cost about as
    much again as a small linear's arithmetic, so the stacked layers keep one of these per
    input shape (:class:`scpdr.lora.StackedLoraLinear`). Plain integers and a name only: the
    tensors' addresses are read at each call (a module may be moved or copied), and it pickles.
    """

    entry: str  # the kernel's function: scpdr_lora_linear_f32, _bf16w or _q4w
    groups: int
    per: int  # rows per group
    n: int
    k: int
    lora: int  # groups with a LoRA delta (the first ones)
    rank: int
    a_offset: int  # bytes from lora_a to group `first`'s matrices
    b_offset: int
    tmp_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def __call__(
        self,
        lib: GemmLibrary,
        x: Tensor,
        weight: Tensor,
        lora_a: Tensor | None,
        lora_b: Tensor | None,
        threads: int,
    ) -> Tensor:
        """``y`` of :func:`lora_linear` for a contiguous float32 CPU ``x`` (its shape as made
        for), shaped ``out_shape``."""
        y = torch.empty(self.out_shape, dtype=torch.float32)
        if self.lora:
            tmp = torch.empty(self.tmp_shape, dtype=torch.float32)
            a = lora_a.data_ptr() + self.a_offset  # type: ignore[union-attr]
            b = lora_b.data_ptr() + self.b_offset  # type: ignore[union-attr]
            t = tmp.data_ptr()
        else:
            a = b = t = None
        getattr(lib.lib.cdll, self.entry)(
            self.groups, self.per, self.n, self.k, x.data_ptr(), weight.data_ptr(), self.lora,
            self.rank, a, b, t, y.data_ptr(), threads,
        )  # fmt: skip
        return y


def linear_call(
    shape: tuple[int, ...],
    weight: Tensor,
    n: int,
    *,
    groups: int,
    lora_a: Tensor | None = None,
    lora_b: Tensor | None = None,
    first: int = 0,
    lora: int = 0,
    rank: int = 0,
) -> LinearCall:
    """The :class:`LinearCall` of :func:`lora_linear`'s arguments for an input of ``shape``
    (``(..., k)``; its rows are G groups of R rows); the output is ``(..., n)``."""
    k, rows = shape[-1], math.prod(shape[:-1])
    if groups < 1 or rows % groups:
        raise ValueError(f"{rows} input rows do not split into {groups} stacked groups")
    per = rows // groups
    if weight.dtype not in _ENTRIES:
        raise ValueError(f"packed panels are float32, bfloat16 or uint8 (q4), not {weight.dtype}")
    if is_q4_panels(weight) and weight.shape[1] * 32 != k:  # the kernel reads k / 32 blocks
        raise ValueError(f"q4 panels of {weight.shape[1] * 32} inputs, but the input has {k}")
    a_offset = b_offset = 0
    tmp_shape: tuple[int, ...] = (0,)
    if lora:
        if lora_a is None or lora_b is None:
            raise ValueError("LoRA groups need lora_a and lora_b")
        tmp_shape = (lora, per, lora_a.shape[1] * lora_a.shape[-1])
        # group `first`'s matrices: pointer arithmetic, not lora_a[first] (a view per call)
        a_offset = first * lora_a.stride(0) * lora_a.element_size()
        b_offset = first * lora_b.stride(0) * lora_b.element_size()
    return LinearCall(
        entry=_ENTRIES[weight.dtype],
        groups=groups,
        per=per,
        n=n,
        k=k,
        lora=lora,
        rank=rank,
        a_offset=a_offset,
        b_offset=b_offset,
        tmp_shape=tmp_shape,
        out_shape=(*shape[:-1], n),
    )


def lora_linear(
    gemm: GemmLibrary,
    x: Tensor,
    weight: Tensor,
    n: int,
    *,
    groups: int,
    lora_a: Tensor | None = None,
    lora_b: Tensor | None = None,
    first: int = 0,
    lora: int = 0,
    rank: int = 0,
    threads: int | None = None,
) -> Tensor:
    """The stacked linear in one kernel call: ``x`` ``(G·R, k)`` float32 contiguous on CPU
    holds G groups of R rows; ``y = x·Wᵀ`` ``(G·R, n)`` for all rows with ``weight`` =
    :func:`pack_panels` of W, then for the first ``lora`` groups ``y_j += (x_j·A_{first+j}ᵀ)·
    (s·B_{first+j})ᵀ`` with ``lora_a`` ``(L, ceil(r / w), k, w)`` (A) and ``lora_b`` ``(L,
    ceil(n / w), r, w)`` (s·B) packed. ``weight`` may be float32, bf16 or q4 panels (the LoRA
    matrices are float32). Split over ``threads`` (default torch's) threads. (A layer called
    at every decoding step keeps its :func:`linear_call` instead.)"""
    call = linear_call(
        tuple(x.shape), weight, n, groups=groups, lora_a=lora_a, lora_b=lora_b, first=first,
        lora=lora, rank=rank,
    )  # fmt: skip
    threads = torch.get_num_threads() if threads is None else threads
    return call(gemm, x, weight, lora_a, lora_b, threads)


def lora_linear_reference(
    x: Tensor,
    weight: Tensor,
    n: int,
    *,
    groups: int,
    lora_a: Tensor | None = None,
    lora_b: Tensor | None = None,
    first: int = 0,
    lora: int = 0,
    rank: int = 0,
) -> Tensor:
    """:func:`lora_linear` in torch ops on the same packed layout (any dtype and device,
    differentiable): ``x·Wᵀ``, then the deltas of the first ``lora`` groups. bf16 and q4
    panels are widened to ``x``'s dtype (exactly, for float32)."""
    k = x.shape[-1]
    y = x @ unpack_panels(weight, n, k).to(x.dtype).t()
    return _add_deltas(y, x, n, groups=groups, lora_a=lora_a, lora_b=lora_b, first=first,
                       lora=lora, rank=rank)  # fmt: skip


def panel_floats(weight: Tensor, k: int) -> Tensor:
    """Float32, bf16 or q4 panels as float32 panels ``(p, k, width)`` (float32 ones as they
    are; the others widened exactly, as the kernel's tiles see them)."""
    if is_q4_panels(weight):
        return q4_panel_floats(weight)
    return _unpaired(weight, k).to(torch.float32)


def lora_linear_torch(x: Tensor, weight: Tensor, n: int, **deltas: Any) -> Tensor:
    """:func:`lora_linear` with torch's matmuls on the packed layout, for calls of many rows
    (prefill, teacher-forced scoring), where torch's sgemm beats the register tiles on some
    machines (measured: :func:`scpdr.lora.gemm_choice.choose_torch_rows`): ``x`` ``(G·R, k)``
    float32 times each panel in one batched matmul (bf16 and q4 panels widened first, exactly),
    then the deltas as :func:`lora_linear_reference` adds them (``deltas``: its keyword
    arguments, ``groups`` ... ``rank``). It differs from the kernel's result only in the order
    of the float additions."""
    rows, k = x.shape
    y = torch.matmul(x, panel_floats(weight, k))  # (p, rows, width)
    y = y.permute(1, 0, 2).reshape(rows, -1)
    y = y[:, :n].contiguous() if y.shape[1] != n else y
    return _add_deltas(y, x, n, **deltas)


def _add_deltas(y: Tensor, x: Tensor, n: int, *, groups: int, lora_a: Tensor | None = None,
                lora_b: Tensor | None = None, first: int = 0, lora: int = 0,
                rank: int = 0) -> Tensor:  # fmt: skip
    """``y`` (the base matmul of ``x``'s G groups of rows) plus the first ``lora`` groups'
    deltas ``(x_j·A_{first+j}ᵀ)·(s·B_{first+j})ᵀ`` from their packed matrices."""
    if not lora:
        return y
    assert lora_a is not None and lora_b is not None
    k = x.shape[-1]
    ys = list(y.view(groups, -1, n).unbind(0))
    xs = x.view(groups, -1, k)
    for j in range(lora):
        a = unpack_panels(lora_a[first + j], rank)  # (r, k) = A
        b = unpack_panels(lora_b[first + j], n)  # (n, r) = s·B
        ys[j] = ys[j] + (xs[j] @ a.t()) @ b.t()
    return torch.cat(ys, 0)
