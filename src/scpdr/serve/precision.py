"""The base weights' precision for decoding on CPU (``scpdr serve --precision``).

- ``fp32``: the base's float32 weights (the packed kernel's float32 panels, or torch's matmuls).
- ``bf16``: the base's weights rounded to bf16 — bf16 panels the packed kernel widens exactly,
  computing in float32 (:class:`scpdr.lora.StackedLoraLinear`), or torch's bf16 matmuls where
  the packed kernel is not used. Half the bytes streamed per decode step; the served model is
  the bf16-rounded one. The certificates stay float32 from its logits.
- ``auto``: bf16 where the CPU reports bf16 units (``amx_bf16``, ``avx512_bf16``) *and*
  :func:`decode_micro_benchmark` finds the bf16 weights at least :data:`MIN_SPEEDUP` times
  faster at the decode steps of batch 1 and of batch 8, else fp32. Measured once per CPU model,
  torch version, thread count, kernel build and packed-GEMM switch, with the training
  precision's machinery (:func:`scpdr.training.precision.resolve_precision`, stored in
  ``$SCPDR_HOME/kernels/precision.choices.json`` under ``decoding (...)|...``);
  ``$SCPDR_DECODE_PRECISION=fp32|bf16`` (:data:`ENV`) replaces the decision without measuring
  (training's ``$SCPDR_PRECISION`` does not: a faster training step is no reason to serve
  bf16-rounded weights).

Why measured, not assumed (``docs/performance.md``): decoding SmolLM2-135M with two rank-64
adapters (``bench_lora``), the bf16 base weights were 1.49x / 1.39x faster at batch 1 / 8 on an
Intel Xeon with AMX, but 1.31x / 0.94x on an AMD EPYC (Zen 4): a step of 24 rows was slower
there. This micro-benchmark picks fp32 on that AMD host and bf16 on two Intel Xeon machines
(model 207, AMX): 1.2-1.5x at batch 1 and 1.3-1.8x at batch 8, on both kernel builds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from scpdr.training.precision import PrecisionChoice, Timings, resolve_precision

__all__ = [
    "DECODE_SHAPES",
    "ENV",
    "MIN_SPEEDUP",
    "decode_dtype",
    "decode_micro_benchmark",
    "measure_bytes",
    "resolve_decode_precision",
]

logger = logging.getLogger(__name__)

#: Environment variable that sets what ``auto`` resolves to for decoding (``fp32``, ``bf16``).
ENV = "SCPDR_DECODE_PRECISION"
#: ``auto`` takes bf16 weights from this speedup at both batch sizes: they change the served
#: model (bf16-rounded weights), worth it for a clear gain, not for noise.
MIN_SPEEDUP = 1.1
#: One transformer layer's linears, ``(in, out, rank)``: SmolLM2-135M's q, k, v, o, gate, up,
#: down with rank-64 adapters (the paper's LoRA setting, App. E).
DECODE_SHAPES = (
    (576, 576, 64),
    (576, 192, 64),
    (576, 192, 64),
    (576, 576, 64),
    (576, 1536, 64),
    (576, 1536, 64),
    (1536, 576, 64),
)
#: Base + 2 LoRA constituents stacked (SCP-Δr-b), at batch 1 and 8.
GROUPS, LORA, BATCHES = 3, 2, (1, 8)
_MIN_BYTES, _MAX_BYTES = 256 << 20, 512 << 20


def _last_level_cache() -> int | None:
    """Bytes of the largest CPU cache sysfs reports for cpu0 (Linux), else None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def measure_bytes() -> int:
    """The float32 weight bytes the micro-benchmark streams per step: twice the last-level cache,
    within [256 MiB, 512 MiB] (at least 1.6x the largest L3 we know of) — a model's decode step
    reads every weight once, from memory, and the bf16 gain is the bytes it saves; a
    cache-resident benchmark would not see it."""
    llc = _last_level_cache() or 0
    return max(_MIN_BYTES, min(_MAX_BYTES, 2 * llc))


def _layers(copies: int, dtype: torch.dtype) -> tuple[list[nn.Module], torch.dtype]:
    """``copies`` x :data:`DECODE_SHAPES` stacked layers, built as :class:`StackedLoRA` builds
    them for a base in ``dtype``: on the packed kernel where the stack would use it (float32
    or bf16 panels), else torch's layers in ``dtype``; and the dtype of their inputs."""
    from scpdr.lora.gemm_choice import choose_gemm, synthetic_layer

    gemm = choose_gemm(list(DECODE_SHAPES), groups=GROUPS, lora=LORA)
    on_torch, panels = (torch.float32, dtype) if gemm is not None else (dtype, torch.float32)
    layers = [
        synthetic_layer(s, LORA, gemm, groups=GROUPS, dtype=on_torch, weight_dtype=panels)
        for _ in range(copies)
        for s in DECODE_SHAPES
    ]
    return layers, on_torch


def decode_micro_benchmark(*, repeats: int = 3, weight_bytes: int | None = None) -> Timings:
    """``(what, bf16 seconds, fp32 seconds)`` of one decode step's linears at batch 1 and 8:
    copies of :data:`DECODE_SHAPES` holding ``weight_bytes`` (default :func:`measure_bytes`) of
    float32 base weights, base + 2 rank-64 adapters stacked (3·B rows), with float32 and with
    bf16 base weights as :class:`StackedLoRA` would run them here; medians of ``repeats``
    interleaved rounds."""
    from scpdr.lora.gemm_choice import time_layers

    per_copy = sum(i * o * 4 for i, o, _ in DECODE_SHAPES)
    copies = max(1, (weight_bytes or measure_bytes()) // per_copy)
    sides = {"bf16": _layers(copies, torch.bfloat16), "fp32": _layers(copies, torch.float32)}
    out = []
    for batch in BATCHES:
        rows = GROUPS * batch
        med = time_layers(sides, rows, repeats=repeats)
        out.append((f"decode step at batch {batch} ({rows} rows)", med["bf16"], med["fp32"]))
    return out


def resolve_decode_precision(
    requested: str,
    *,
    device: str = "cpu",
    flags: Iterable[str] | None = None,
    measure: Callable[[], Timings] | None = None,
) -> PrecisionChoice:
    """The base weights' precision for decoding on ``device`` (module docstring): ``fp32`` or
    ``bf16`` as asked; ``auto`` measured on a CPU with bf16 units (``measure``, default
    :func:`decode_micro_benchmark`), bf16 on a GPU that supports it. Logged once at INFO. The
    decision is the kernel build's (:func:`scpdr.kernels.default_target`) under the packed
    GEMM's switch (``SCPDR_GEMM_KERNEL``): the AVX2 build, or torch's layers, may choose
    otherwise than the native kernel."""
    from scpdr import kernels

    gemm = kernels.policy(kernels.gemm.NAME)
    return resolve_precision(
        requested,
        device=device,
        flags=flags,
        measure=measure or decode_micro_benchmark,
        purpose=f"decoding ({kernels.default_target()} build, packed GEMM {gemm})",
        min_speedup=MIN_SPEEDUP,
        env=ENV,
    )


def decode_dtype(precision: str, device: str = "cpu") -> torch.dtype | None:
    """The ``dtype`` to load the models of a protected model in for ``--precision``
    (``scpdr serve``, ``scpdr eval``): float32 or bfloat16 as asked; for ``auto`` None on CUDA
    (the device's default, bf16) and on CPU bfloat16 where :func:`resolve_decode_precision`
    picks it (measured once per CPU model; ``$SCPDR_DECODE_PRECISION`` replaces it), else None
    (the checkpoint's float32). The CPU's choice and its reason are logged at INFO."""
    from scpdr.device import is_cuda

    if precision == "auto" and is_cuda(device):
        return None
    choice = resolve_decode_precision(precision, device=device)
    if precision == "auto":
        logger.info("decoding precision: %s", choice.summary)
        return torch.bfloat16 if choice.bf16 else None
    return torch.bfloat16 if choice.bf16 else torch.float32
