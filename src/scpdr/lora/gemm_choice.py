"""Kernel or torch for the shared-base LoRA fast path's linears (:mod:`scpdr.lora.layers`), the
packed kernel's next-panel prefetch, and GGUF Q4_1 blocks or float32 panels for a base loaded
from a GGUF file (:mod:`scpdr.kernels.q4`): each measured on the model's shapes on this machine at
first use (a fraction of a second each), logged once and remembered beside the kernel's build in
``$SCPDR_HOME/kernels`` (``SCPDR_GEMM_KERNEL=0``/``1`` forces a side without measuring).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from scpdr import kernels
from scpdr.kernels.gemm import GemmLibrary
from scpdr.kernels.q4 import dequantize_blocks
from scpdr.lora.layers import GroupMode, StackedLoraLinear

__all__ = [
    "MANY_ROWS",
    "MEASURE_ROWS_PER_GROUP",
    "MEASURE_WEIGHT_BYTES",
    "StackKernel",
    "choose_gemm",
    "choose_prefetch",
    "choose_q4",
    "choose_stack_kernel",
    "choose_torch_rows",
    "gains_outweigh_losses",
    "q4_pays",
    "synthetic_layer",
    "time_layers",
]

#: Bytes of float32 weights the first-use measurement of :func:`choose_gemm` runs through per
#: call (copies of the model's distinct linear shapes): near this machine class's L3 (32 MiB),
#: so that most of them stream from memory as in decoding.
MEASURE_WEIGHT_BYTES = 32 << 20
#: Rows per group the measurement times: decode steps of batch 1 and 8.
MEASURE_ROWS_PER_GROUP = (1, 8)
#: Row counts of a call (all groups) at which :func:`choose_torch_rows` times the kernel against
#: torch's matmuls on the same panels (prefill and teacher-forced scoring), largest first.
MANY_ROWS = (256, 64)
_TITLE = "packed GEMM"


def synthetic_layer(
    shape: tuple[int, int, int],
    lora: int,
    gemm: GemmLibrary | None,
    *,
    groups: int,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype = torch.float32,
    q4: bool = False,
    keep_original: bool = False,
) -> StackedLoraLinear:
    """A :class:`StackedLoraLinear` of ``(in, out, rank)`` with ``lora`` adapters and constant
    weights (their values do not change the speed), seeing ``groups`` stacked groups: packed
    for ``gemm`` (base panels in ``weight_dtype``) or on torch's layout in ``dtype``. What the
    kernel/torch, decoding-precision and q4 measurements time. ``q4`` (``in`` a multiple of 32):
    the weight is that of constant Q4_1 blocks, packed as q4 panels; ``keep_original``: the
    packed layer keeps the ``nn.Linear`` too (:class:`StackedLoraLinear`)."""
    n_in, n_out, rank = shape
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype)
    layer.weight.requires_grad_(False).fill_(0.01)
    blocks = None
    if q4:
        blocks = torch.zeros(n_out, n_in // 32, 20, dtype=torch.uint8)
        blocks[..., 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        blocks[..., 4:] = 0x11  # q = 1: w = fl(d)
        layer.weight.copy_(dequantize_blocks(blocks))
    a = b = None
    if rank:
        a = torch.full((lora, n_in, rank), 0.01, dtype=dtype)
        b = torch.full((lora, rank, n_out), 0.01, dtype=dtype)
    mode = GroupMode()
    mode.stacked = groups
    return StackedLoraLinear(
        layer, a, b, mode, gemm=gemm, weight_dtype=weight_dtype, q4=blocks,
        keep_original=keep_original,
    )  # fmt: skip


def time_layers(
    sides: dict[str, tuple[list[StackedLoraLinear], torch.dtype]],
    rows: int,
    *,
    repeats: int,
    before: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Median seconds of one pass of each side's layers over ``rows`` input rows of the side's
    dtype, the sides timed round-robin (:func:`scpdr.kernels.interleaved_medians`);
    ``before(side)``, if given, runs (timed) before each pass of that side."""
    xs = {
        side: {lin.in_features: torch.full((rows, lin.in_features), 0.5, dtype=dtype)
               for lin in layers}
        for side, (layers, dtype) in sides.items()
    }  # fmt: skip

    def run(side: str) -> None:
        if before is not None:
            before(side)
        for lin in sides[side][0]:
            lin(xs[side][lin.in_features])

    with torch.inference_mode():
        return kernels.interleaved_medians(
            {side: (lambda s=side: run(s)) for side in sides}, repeats=repeats
        )


def _copies(
    gemm: GemmLibrary | None,
    shapes: list[tuple[int, int, int]],
    groups: int,
    lora: int,
    *,
    q4: bool = False,
    weight_dtype: torch.dtype = torch.float32,
    keep_original: bool = False,
) -> list[StackedLoraLinear]:
    """Synthetic layers of ``shapes``, copied up to :data:`MEASURE_WEIGHT_BYTES` of float32
    weights (the same number of copies with ``q4`` or bf16 ``weight_dtype``)."""
    per_copy = sum(i * o * 4 for i, o, _ in shapes)
    copies = max(1, min(MEASURE_WEIGHT_BYTES // max(1, per_copy), 128 // len(shapes)))
    return [synthetic_layer(s, lora, gemm, groups=groups, q4=q4, weight_dtype=weight_dtype,
                            keep_original=keep_original)
            for _ in range(copies) for s in shapes]  # fmt: skip


def _at_decode_rows(
    sides: dict[str, tuple[list[StackedLoraLinear], torch.dtype]], groups: int
) -> list[tuple[str, float, float]]:
    """``(what, first side's seconds, second side's)`` at the decode steps of batch 1 and 8."""
    first, second = sides
    out = []
    for per in MEASURE_ROWS_PER_GROUP:
        rows = groups * per
        med = time_layers(sides, rows, repeats=5)
        out.append((f"at {rows} rows", med[first], med[second]))
    return out


def _measure(
    gemm: GemmLibrary, shapes: list[tuple[int, int, int]], groups: int, lora: int
) -> list[tuple[str, float, float]]:
    sides = {side: (_copies(g, shapes, groups, lora), torch.float32)
             for side, g in (("kernel", gemm), ("torch", None))}  # fmt: skip
    return _at_decode_rows(sides, groups)


def _measure_prefetch(
    gemm: GemmLibrary, shapes: list[tuple[int, int, int]], groups: int, lora: int, rows: int
) -> list[tuple[str, float, float]]:
    layers = (_copies(gemm, shapes, groups, lora), torch.float32)
    try:  # the same layers both sides, the build's flag set before each pass
        med = time_layers(
            {"on": layers, "off": layers},
            rows,
            repeats=7,
            before=lambda side: gemm.set_prefetch(side == "on"),
        )
    finally:
        gemm.set_prefetch(True)
    return [(f"at {rows} rows", med["on"], med["off"])]


def _remembered(
    gemm: GemmLibrary,
    key: str,
    measure: Callable[[], list[tuple[str, float, float]]],
    *,
    what: str,
    states: tuple[str, str],
    reason: str,
    min_speedup: float = 1.0,
    decide: Callable[[Sequence[tuple[str, float, float]]], bool] | None = None,
) -> bool:
    """The build's stored decision ``key`` (else ``measure()``-d and stored), logged as
    ``<what> <speedups>: <states[0] if taken else states[1]>``."""

    def describe(choice: kernels.Choice) -> str:
        parts = [f"{ref / new:.2g}× {case}" for case, new, ref in choice.timings if new > 0]
        state = states[0] if choice.use_kernel else states[1]
        return f"{_TITLE} ({gemm.lib.label}): {what} {', '.join(parts)}: {state}"

    return kernels.build.measured_choice(
        kernels.build.choices_file(gemm.lib), key, measure, describe=describe, reason=reason,
        min_speedup=min_speedup, decide=decide,
    ).use_kernel  # fmt: skip


def choose_prefetch(
    gemm: GemmLibrary, shapes: list[tuple[int, int, int]], *, groups: int, lora: int
) -> bool:
    """Whether ``gemm`` prefetches the next panel (``packed_gemm.c``): measured with and
    without at the decode step of batch 8 (8·G rows; the prefetch only runs where a panel takes
    two tiles or more, so with fewer rows there is nothing to decide and the build's setting
    stays), kept only if faster, and set on the build (one setting per build: the last stack
    measured decides). Measured on an Intel Xeon (Cascade Lake): the AVX2 build's linears at
    24 rows 14.3-14.8 -> 10.9-11.7 ms with it."""
    rows = groups * MEASURE_ROWS_PER_GROUP[-1]
    if rows <= gemm.tile_rows:  # nothing to decide: the build's setting stays
        return gemm.prefetch
    key = f"prefetch-G{groups}-L{lora}-" + hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    on = _remembered(
        gemm,
        key,
        lambda: _measure_prefetch(gemm, shapes, groups, lora, rows),
        what="next-panel prefetch",
        states=("on", "off"),
        reason="measured with and without",
    )
    gemm.set_prefetch(on)
    return on


def choose_gemm(
    shapes: Sequence[tuple[int, int, int]], *, groups: int, lora: int
) -> GemmLibrary | None:
    """The packed GEMM to run a stack's linears with, or None for torch's matmuls.

    ``shapes``: ``(in, out, rank)`` of the float32 CPU linears to wrap (rank 0: no adapter);
    ``groups``: G stacked groups, ``lora``: L of them with adapters. The build must load, have
    a register tile for its ISA, and be forced on (``SCPDR_GEMM_KERNEL=1``,
    :func:`scpdr.kernels.force`) or be faster than the torch layers over the measured cases
    taken together (:func:`gains_outweigh_losses`): copies of the distinct shapes (each at most
    half of :data:`MEASURE_WEIGHT_BYTES`, which leaves out a large output head) at the decode
    steps of batch 1 and 8 (G and 8·G rows), both sides timed in the same moment, after the
    kernel's prefetch is chosen (:func:`choose_prefetch`). The decisions are logged once and
    remembered. (The rule before asked the kernel to win at both: on an Intel Xeon (Emerald
    Rapids) a near-tie at 24 rows, 1.6× torch at 3 rows and 0.98× at 24, put a protected
    decoding step on torch's matmuls at 2.5× the kernel's time at batch 1.)
    """
    side = kernels.policy(kernels.gemm.NAME)
    if side == "torch" or not shapes:
        return None
    gemm = kernels.gemm.library()
    if gemm is None:
        return None
    if not gemm.tiled:
        reason = f"no register tile for the {gemm.lib.isa} instruction set"
        kernels.build.remembered(gemm.lib, "untiled", kernels.Choice(False, reason), title=_TITLE)
        return None
    if side == "kernel":
        return gemm
    small = sorted({s for s in shapes if s[0] * s[1] * 8 <= MEASURE_WEIGHT_BYTES})
    distinct = small or [min(shapes, key=lambda s: s[0] * s[1])]
    choose_prefetch(gemm, distinct, groups=groups, lora=lora)  # first: the kernel as it runs
    digest = hashlib.sha256(repr(distinct).encode()).hexdigest()[:12]
    choice = kernels.choose(
        gemm.lib,
        f"G{groups}-L{lora}-{digest}-net",  # (the rule before, "G..-<digest>": faster at both)
        lambda: _measure(gemm, distinct, groups, lora),
        title=_TITLE,
        decide=gains_outweigh_losses,
    )
    return gemm if choice.use_kernel else None


def _measure_q4(
    gemm: GemmLibrary, shapes: list[tuple[int, int, int]], groups: int, lora: int
) -> list[tuple[str, float, float]]:
    """``(case, q4 seconds, float32 panels' seconds)`` at the decode steps of batch 1 and 8,
    then ``(case + " vs torch", q4 seconds, torch's seconds)``: three sides, same moment."""
    sides = {side: (_copies(gemm if side != "torch" else None, shapes, groups, lora,
                            q4=side == "q4"), torch.float32)
             for side in ("q4", "float32", "torch")}  # fmt: skip
    out, torch_cases = [], []
    for per in MEASURE_ROWS_PER_GROUP:
        rows = groups * per
        med = time_layers(sides, rows, repeats=5)
        out.append((f"at {rows} rows", med["q4"], med["float32"]))
        torch_cases.append((f"at {rows} rows vs torch", med["q4"], med["torch"]))
    return out + torch_cases


def gains_outweigh_losses(timings: Sequence[tuple[str, float, float]]) -> bool:
    """Whether a candidate's speedups over its reference, ``reference / candidate`` seconds per
    case ``(what, candidate s, reference s)``, multiply to more than 1: a loss in one case (the
    decode step of batch 8, say) must be outweighed by the gain in another (batch 1), each
    batch size counted alike. :func:`choose_gemm`'s rule, and :func:`q4_pays`'s against float32
    panels."""
    return bool(timings) and math.prod(ref / new for _, new, ref in timings) > 1


def q4_pays(timings: Sequence[tuple[str, float, float]]) -> bool:
    """:func:`choose_q4`'s rule on :func:`_measure_q4`'s timings: the blocks' speedups over
    float32 panels multiply to more than 1 over the decode steps of batch 1 and 8 (a loss at one
    must be outweighed by the gain at the other), and they are no slower than torch at either."""
    vs_torch = [t for t in timings if t[0].endswith("vs torch")]
    return gains_outweigh_losses([t for t in timings if t not in vs_torch]) and all(
        ref >= q4 for _, q4, ref in vs_torch
    )


def choose_q4(
    gemm: GemmLibrary, shapes: Sequence[tuple[int, int, int]], *, groups: int, lora: int
) -> bool:
    """Whether ``gemm`` runs a base's GGUF Q4_1 blocks (:mod:`scpdr.kernels.q4`) instead of its
    float32 panels: ``shapes`` ``(in, out, rank)`` of the linears the file holds in blocks,
    timed with q4 and float32 panels (the same values) and on torch at the decode steps of
    batch 1 and 8 (G and 8·G rows), all in the same moment, and kept where the speedups over
    float32 panels multiply to more than 1 and it is no slower than torch at either
    (:func:`q4_pays`: a loss at one batch size must be outweighed by the gain at the other;
    the blocks also take ~1/5 of the memory). Measured on an Intel Xeon (Cascade Lake), the
    x86-64-v3 build: 1.5x at 3 rows, 0.94x at 24 (its AVX2 tiles are compute-bound at 24 rows,
    and rebuilding each weight adds to their work): taken. Forced like the kernel
    (``SCPDR_GEMM_KERNEL=1``: on). The decision is logged once and remembered.
    """
    side = kernels.policy(kernels.gemm.NAME)
    if side == "kernel":
        return True
    distinct = sorted({s for s in shapes if s[0] % 32 == 0})
    if side == "torch" or not distinct:
        return False
    digest = hashlib.sha256(repr(distinct).encode()).hexdigest()[:12]
    return _remembered(
        gemm,
        f"q4-pays-G{groups}-L{lora}-{digest}",  # (the rule before: "q4-", faster at both)
        lambda: _measure_q4(gemm, distinct, groups, lora),
        what="GGUF Q4_1 weights",
        states=("q4 blocks", "float32 panels"),
        reason="measured against float32 panels and torch",
        decide=q4_pays,
    )


@dataclass(frozen=True)
class StackKernel:
    """Where a stack's linears run (:func:`choose_stack_kernel`): ``gemm``, the packed kernel's
    build (None: torch's matmuls for all of them); ``panels``, whether the linears without
    GGUF blocks run on its float32 (or bf16) panels (:func:`choose_gemm`); ``q4``, whether
    those with blocks run on their Q4_1 blocks (:func:`choose_q4`)."""

    gemm: GemmLibrary | None = None
    panels: bool = False
    q4: bool = False

    def for_layer(self, blocks: bool) -> GemmLibrary | None:
        """The build a linear runs on, None for torch's matmuls: on its Q4_1 blocks where it
        has them (``blocks``) and those are taken, else on panels where those are."""
        return self.gemm if self.panels or (blocks and self.q4) else None


def choose_stack_kernel(
    shapes: Sequence[tuple[int, int, int]],
    q4_shapes: Sequence[tuple[int, int, int]] = (),
    *,
    groups: int,
    lora: int,
) -> StackKernel:
    """The packed kernel's part in a stack's linears, measured as it would run them: on panels
    where :func:`choose_gemm` measured them faster than torch (``shapes``: all the linears),
    and on a GGUF base's Q4_1 blocks (``q4_shapes``: the linears the file holds in blocks)
    where :func:`choose_q4` measured those faster than float32 panels and torch — also where
    the panels are not: the blocks stream ~3/16 of float32's bytes, so the kernel on them can
    beat torch where it does not on panels. Measured on an Intel Xeon (Emerald Rapids): panels
    1.6× torch at 3 rows and 0.98× at 24, blocks 3.1× and 1.6×. Forced like the kernel
    (``SCPDR_GEMM_KERNEL``)."""
    gemm = choose_gemm(shapes, groups=groups, lora=lora) if shapes else None
    lib = gemm
    if lib is None and q4_shapes and kernels.policy(kernels.gemm.NAME) == "auto":
        found = kernels.gemm.library()  # the panels lost to torch: the blocks may still win
        lib = found if found is not None and found.tiled else None
    q4 = lib is not None and bool(q4_shapes) and choose_q4(lib, q4_shapes, groups=groups, lora=lora)
    if gemm is None and not q4:
        return StackKernel()
    return StackKernel(lib, panels=gemm is not None, q4=q4)


def _measure_many_rows(
    gemm: GemmLibrary,
    shapes: list[tuple[int, int, int]],
    groups: int,
    lora: int,
    rows: int,
    weight_format: str,
    keep_original: bool,
) -> list[tuple[str, float, float]]:
    layers = _copies(
        gemm, shapes, groups, lora, q4=weight_format == "q4_1",
        weight_dtype=torch.bfloat16 if weight_format == "bf16" else torch.float32,
        keep_original=keep_original,
    )  # fmt: skip

    def side(name: str) -> None:
        for lin in layers:
            lin.torch_rows = 1 if name == "torch" else None

    med = time_layers(
        {"torch": (layers, torch.float32), "kernel": (layers, torch.float32)},
        rows,
        repeats=7,
        before=side,
    )
    return [(f"at {rows} rows", med["torch"], med["kernel"])]


def choose_torch_rows(
    gemm: GemmLibrary,
    shapes: Sequence[tuple[int, int, int]],
    *,
    groups: int,
    lora: int,
    weight_format: str = "float32",
    keep_original: bool = False,
) -> int | None:
    """From how many rows a call of the stack's linears on ``gemm`` (panels of
    ``weight_format``: "float32", "bf16" or "q4_1") runs torch's matmuls on the panels instead
    (:func:`scpdr.kernels.gemm.lora_linear_torch`; with ``keep_original``, the layers' kept
    ``nn.Linear``), or None: the kernel at every size. Decoding steps have few rows, where the
    register tiles win; a prefill or a teacher-forced score has hundreds, where torch's sgemm
    (MKL) can be faster (measured on an Intel Xeon, Cascade Lake, the model's linears at 256
    rows: the AVX2 build 0.56x torch, the AVX-512 one 0.93x). Timed at :data:`MANY_ROWS` (the
    same layers both ways, in the same moment), largest first: torch from the smallest count
    where it was at least 1.1x faster (a tie keeps the kernel; with ``keep_original``, unless it
    was more than 5% slower: a tie runs the plain layer), and at every larger one. Forced like
    the kernel (``SCPDR_GEMM_KERNEL=1``: None). The decisions are logged once and remembered."""
    if kernels.policy(kernels.gemm.NAME) == "kernel" or not shapes:
        return None
    small = sorted({s for s in shapes if s[0] * s[1] * 8 <= MEASURE_WEIGHT_BYTES})
    distinct = small or [min(shapes, key=lambda s: s[0] * s[1])]
    digest = hashlib.sha256(repr(distinct).encode()).hexdigest()[:12]
    found = None
    side = "the original weights" if keep_original else f"{weight_format} panels"
    for many in MANY_ROWS:
        rows = -(-many // groups) * groups  # whole groups
        if rows <= groups * MEASURE_ROWS_PER_GROUP[-1]:  # a decoding step's size: the kernel's
            break
        torch_faster = _remembered(
            gemm,
            f"torch-rows{rows}-{weight_format}{'-kept' * keep_original}-G{groups}-L{lora}-{digest}",
            lambda r=rows: _measure_many_rows(
                gemm, distinct, groups, lora, r, weight_format, keep_original
            ),
            what=f"torch's matmuls on {side}",
            states=("torch", "kernel"),
            reason="measured against the kernel",
            # the original (the plain layer's own results): torch unless >5% slower; panels:
            # torch only where clearly faster
            min_speedup=0.95 if keep_original else 1.1,
        )
        if not torch_faster:
            break
        found = rows
    return found
