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

What is measured is what each precision would run for the model being served
(:class:`DecodeForm`, :func:`decode_form`): a LoRA bundle's stack (base + adapters in one
forward, on the packed kernel) or one forward per full model (torch's matmuls; bf16 loads the
models in bf16), and, where the base was loaded from a GGUF file (the embedded model), float32
as it decodes that base: from the file's Q4_1 blocks where the packed kernel measured them faster
(:func:`scpdr.lora.choose_q4`). Those stream ~3/16 of float32's bytes, against bf16's 1/2, and
are the float32 model bit for bit. Each form is a decision of its own.

Why measured, not assumed (``docs/performance.md``): decoding SmolLM2-135M with two rank-64
adapters (``bench_lora``), the bf16 base weights were 1.49x / 1.39x faster at batch 1 / 8 on an
Intel Xeon with AMX, but 1.31x / 0.94x on an AMD EPYC (Zen 4): a step of 24 rows was slower
there. This micro-benchmark picks fp32 on that AMD host and bf16 on two Intel Xeon machines
(model 207, AMX): 1.2-1.5x at batch 1 and 1.3-1.8x at batch 8, on both kernel builds. On an
Intel Xeon with AMX (family 6 model 167, 2 vCPUs) bf16 panels were 1.2x float32 panels but
0.62-0.73x the GGUF base's Q4_1 blocks, and SCP-Δr-b over the embedded base served 8-10% slower
in bf16 (LoRA) and 0.76x at batch 1 (full models, 1.31x at batch 8): over a GGUF base the
comparison is with the blocks.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scpdr.training.precision import PrecisionChoice, Timings, resolve_precision

__all__ = [
    "DECODE_SHAPES",
    "ENV",
    "MIN_SPEEDUP",
    "DecodeForm",
    "decode_dtype",
    "decode_form",
    "decode_layers",
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


@dataclass(frozen=True)
class DecodeForm:
    """What a served model's decoding step runs, as far as the precision changes it.

    ``stacked``: a LoRA bundle on the fast path (:class:`~scpdr.lora.StackedLoRA`: the base and
    the adapters in one forward on the packed kernel; bf16 keeps bf16 panels); False: one forward
    per full model (each model's own matmuls; bf16 loads them in bf16). ``gguf_base``: the base
    was loaded from a GGUF file (:func:`scpdr.lora.gguf_file`), so float32 decodes it from its
    Q4_1 blocks where this machine measured that faster."""

    stacked: bool = True
    gguf_base: bool = False

    @property
    def label(self) -> str:
        """``LoRA stack`` / ``full models``, ``over a GGUF base`` where it is one."""
        kind = "LoRA stack" if self.stacked else "full models"
        return kind + (" over a GGUF base" if self.gguf_base else "")


def decode_form(
    bundle: str | os.PathLike[str], *, method: str | None = None, base: str = "model"
) -> DecodeForm:
    """The :class:`DecodeForm` of ``bundle`` served with ``method`` (default: the bundle's)
    and ``base`` (``model``/``constant``, as ``ProtectedLM.from_bundle``): stacked where every
    constituent is a PEFT adapter; a GGUF base where the models' base (the adapters' for a
    stack, the bundle's base model where the method runs it) is a GGUF file or the embedded
    model. ``SCPDR_LORA_FAST=0`` (the fast path off) makes every bundle full models. Reads the
    manifest and the adapters' configs only; refs that cannot be read count as full models
    without a GGUF base (loading then says what is wrong)."""
    from scpdr import methods
    from scpdr.lora.loading import fast_path_enabled, gguf_file
    from scpdr.models import adapter_base_ref, read_bundle, ref_kind

    manifest = read_bundle(bundle)
    method = method or manifest.method
    refs = [manifest.resolve(bundle, r) for r in manifest.constituents]
    try:
        kinds = [ref_kind(r) for r in refs]
        if fast_path_enabled() and method != "none" and kinds and all(k == "peft" for k in kinds):
            common = adapter_base_ref(Path(refs[0]))
            return DecodeForm(stacked=True, gguf_base=gguf_file(common) is not None)
    except FileNotFoundError:
        return DecodeForm(stacked=False)
    runs_base = method in methods.SMOOTHED_RULES and base == "model" and manifest.base is not None
    gguf = runs_base and gguf_file(manifest.resolve(bundle, str(manifest.base))) is not None
    return DecodeForm(stacked=False, gguf_base=gguf)


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


def _stacked_layers(
    copies: int, dtype: torch.dtype, q4: bool
) -> tuple[list[nn.Module], torch.dtype]:
    """``copies`` x :data:`DECODE_SHAPES` stacked layers, built as :class:`StackedLoRA` builds
    them for a base in ``dtype``: on the packed kernel where the stack would use it (float32
    panels, the GGUF base's Q4_1 blocks where ``q4`` and
    :func:`~scpdr.lora.choose_stack_kernel` takes them, or bf16 panels), else torch's layers in
    ``dtype``; and the dtype of their inputs."""
    from scpdr.lora.gemm_choice import choose_stack_kernel, synthetic_layer

    shapes = list(DECODE_SHAPES)
    blocks = shapes if q4 and dtype == torch.float32 else []
    stack = choose_stack_kernel(shapes, blocks, groups=GROUPS, lora=LORA)
    gemm = stack.for_layer(bool(blocks))
    on_torch, panels = (torch.float32, dtype) if gemm is not None else (dtype, torch.float32)
    layers = [
        synthetic_layer(
            s, LORA, gemm, groups=GROUPS, dtype=on_torch, weight_dtype=panels, q4=stack.q4
        )
        for _ in range(copies)
        for s in DECODE_SHAPES
    ]
    return layers, on_torch


def _full_layers(copies: int, dtype: torch.dtype, q4: bool) -> tuple[list[nn.Module], torch.dtype]:
    """SCP-Δr-b over full models (:func:`scpdr.lora.pack_full_model`): two fine-tunes' and the
    base's linears, ``copies`` x :data:`DECODE_SHAPES` in all, one model at a time on torch's
    matmuls in ``dtype``, except a float32 base on its Q4_1 blocks where ``q4`` and the packed
    kernel measured them faster than float32 panels and torch
    (:func:`~scpdr.lora.choose_stack_kernel` at one group); and the dtype of their inputs."""
    from scpdr.lora.gemm_choice import StackKernel, choose_stack_kernel, synthetic_layer

    shapes = [(i, o, 0) for i, o, _ in DECODE_SHAPES]
    stack = StackKernel()  # the base on torch's matmuls, unless on its blocks
    if q4 and dtype == torch.float32:
        stack = choose_stack_kernel(shapes, shapes, groups=1, lora=0)
    gemm, blocks = stack.gemm, stack.q4
    per_model = max(1, copies // GROUPS)
    layers = [
        synthetic_layer(s, 0, gemm if base and blocks else None, groups=1, dtype=dtype,
                        q4=base and blocks)
        for base in [False] * (GROUPS - 1) + [True]
        for _ in range(per_model)
        for s in shapes
    ]  # fmt: skip
    return layers, dtype


def decode_layers(
    form: DecodeForm, dtype: torch.dtype, *, copies: int
) -> tuple[list[nn.Module], torch.dtype]:
    """The linears :func:`decode_micro_benchmark` times for ``form`` with base weights in
    ``dtype`` (``copies`` x :data:`DECODE_SHAPES` of base weights), built as the served model
    would hold them here, and the dtype of their inputs: a LoRA stack's base + 2 rank-64
    adapters on the packed kernel where the stack would use it (float32 panels, bf16 panels, or
    the GGUF base's Q4_1 blocks in float32 where :func:`~scpdr.lora.choose_q4` takes them), else
    torch's layers; full models: two fine-tunes' and the base's linears one model after the
    other, on torch's matmuls in ``dtype`` except a float32 GGUF base on its Q4_1 blocks where
    the packed kernel measured them faster (:func:`scpdr.lora.pack_full_model`)."""
    build = _stacked_layers if form.stacked else _full_layers
    return build(copies, dtype, form.gguf_base)


def decode_micro_benchmark(
    *, repeats: int = 3, weight_bytes: int | None = None, form: DecodeForm | None = None
) -> Timings:
    """``(what, bf16 seconds, fp32 seconds)`` of one decode step's linears at batch 1 and 8:
    copies of :data:`DECODE_SHAPES` holding ``weight_bytes`` (default :func:`measure_bytes`) of
    float32 base weights, run as ``form`` (default: a LoRA stack, base + 2 rank-64 adapters
    stacked in 3·B rows; full models: three models of B rows one after the other) runs them
    here in float32 and with bf16 weights; medians of ``repeats`` interleaved rounds."""
    from scpdr.lora.gemm_choice import time_layers

    form = form or DecodeForm()
    per_copy = sum(i * o * 4 for i, o, _ in DECODE_SHAPES)
    copies = max(1, (weight_bytes or measure_bytes()) // per_copy)
    sides = {
        "bf16": decode_layers(form, torch.bfloat16, copies=copies),
        "fp32": decode_layers(form, torch.float32, copies=copies),
    }
    out = []
    for batch in BATCHES:
        rows = GROUPS * batch if form.stacked else batch
        med = time_layers(sides, rows, repeats=repeats)
        out.append((f"decode step at batch {batch} ({rows} rows)", med["bf16"], med["fp32"]))
    return out


def resolve_decode_precision(
    requested: str,
    *,
    device: str = "cpu",
    flags: Iterable[str] | None = None,
    measure: Callable[[], Timings] | None = None,
    form: DecodeForm | None = None,
) -> PrecisionChoice:
    """The base weights' precision for decoding on ``device`` (module docstring): ``fp32`` or
    ``bf16`` as asked; ``auto`` measured on a CPU with bf16 units (``measure``, default
    :func:`decode_micro_benchmark` of ``form``, default a LoRA stack), bf16 on a GPU that
    supports it. Logged once at INFO. The decision is the kernel build's
    (:func:`scpdr.kernels.default_target`) under the packed GEMM's switch
    (``SCPDR_GEMM_KERNEL``) for ``form``: the AVX2 build, torch's layers, full models or a GGUF
    base may choose otherwise than a LoRA stack on the native kernel."""
    from scpdr import kernels

    form = form or DecodeForm()
    gemm = kernels.policy(kernels.gemm.NAME)
    if gemm == "auto":  # measured by gains_outweigh_losses: decisions under the rule before
        gemm = "by net gain"  # (the kernel faster at both batch sizes) are not reused
    return resolve_precision(
        requested,
        device=device,
        flags=flags,
        measure=measure or functools.partial(decode_micro_benchmark, form=form),
        purpose=f"decoding ({kernels.default_target()} build, packed GEMM {gemm}, {form.label})",
        min_speedup=MIN_SPEEDUP,
        env=ENV,
    )


#: The "decoding precision: ..." lines this process has logged.
_LOGGED: set[str] = set()


def decode_dtype(
    precision: str, device: str = "cpu", *, form: DecodeForm | None = None
) -> torch.dtype | None:
    """The ``dtype`` to load the models of a protected model in for ``--precision``
    (``scpdr serve``, ``scpdr eval``): float32 or bfloat16 as asked; for ``auto`` None on CUDA
    (the device's default, bf16) and on CPU bfloat16 where :func:`resolve_decode_precision`
    picks it for ``form`` (:func:`decode_form` of the bundle; measured once per CPU model;
    ``$SCPDR_DECODE_PRECISION`` replaces it), else None (the checkpoint's float32). The CPU's
    choice and its reason are logged at INFO, once per process."""
    from scpdr.device import is_cuda

    if precision == "auto" and is_cuda(device):
        return None
    choice = resolve_decode_precision(precision, device=device, form=form)
    if precision == "auto":
        line = f"decoding precision: {choice.summary}"
        if line not in _LOGGED:  # once per process (a plan resolves it per stage)
            _LOGGED.add(line)
            logger.info("%s", line)
        return torch.bfloat16 if choice.bf16 else None
    return torch.bfloat16 if choice.bf16 else torch.float32
