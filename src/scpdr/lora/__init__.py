"""Shared-base fast path for LoRA constituents (paper App. E, Table 6: LoRA fine-tunes).

When every model that :class:`scpdr.runtime.ProtectedLM` runs is a PEFT LoRA adapter over one
base model (or that base model itself, e.g. the base of SCP-Δr-b, Alg. 1), the models share all
base weights and differ by low-rank deltas ``ΔW_g = s_g·B_g A_g`` (s_g = α/r, or α/√r with
rsLoRA). Decoding is memory-bound, so instead of G = K (+1) forwards this package runs **one**
forward of the base over a stacked batch of G·B rows (row ``g·B + b`` is row b of model g):

- every ``nn.Linear`` of the base is wrapped by :class:`StackedLoraLinear`
  (:mod:`scpdr.lora.layers`); a targeted one holds the stacked ``A`` ``(L, in, r)`` and scaled
  ``B`` ``(L, r, out)`` of the L leading groups that carry adapters (the plain-base group, last
  in SCP-Δr-b, has no delta and costs nothing); its input ``(G·B, T, in)`` is viewed as ``(G,
  B·T, in)`` and the deltas of all groups come from two batched matmuls ``bmm(x, A)`` then
  ``baddbmm(y, ·, B)``, no per-adapter Python loop;
- on CPU in float32 every linear (base matmul of all stacked rows plus the groups' deltas) is
  one call of a C kernel on weights re-laid out once in panels (``kernels/packed_gemm.c``, a
  register tile per ISA): where :func:`scpdr.lora.gemm_choice.choose_gemm` measured it faster than
  torch's sgemm on this machine (2-3x with AVX-512 or AVX2 here); a tied input embedding is
  then looked up in the packed head (:class:`PackedEmbedding`). Otherwise — no C compiler, no
  tile for the ISA, slower here, or ``SCPDR_GEMM_KERNEL=0`` — torch's matmuls are used
  (``docs/lora_fast_path.md``);
- different ranks are zero-padded to the largest (exact: padded rows/columns add 0); modules that
  only some adapters target get zero matrices for the others;
- one KV cache (:func:`new_stacked_cache`) holds the stacked batch; dropping finished rows
  selects the same rows in every group;
- an ``lm_head`` adapter on a model with tied embeddings is a delta on the output projection
  only (PEFT's unmerged semantics; ``scpdr.models.load_model`` unties before merging so that the
  general path agrees).

Anything else falls back to the general path (one model per constituent), with the reason
logged at INFO: different bases, a full (non-adapter) constituent, "none" (one model), non-LoRA
PEFT types, DoRA, ``modules_to_save``/trainable tokens, LoRA biases, ``alpha_pattern``, targets
that are not ``nn.Linear``, adapters whose shapes do not fit the base, or ``SCPDR_LORA_FAST=0``.

Results equal the general path's (log-probs within ~1e-5, identical greedy tokens): the only
difference is the order of floating-point additions (``x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` instead of
``x·(W + s·B·A)ᵀ``). Like the KV caches, a stack serves one forward at a time (not thread-safe).

Modules: :mod:`~scpdr.lora.adapters` (read PEFT adapters, write random ones),
:mod:`~scpdr.lora.layers` (the wrapped linears), :mod:`~scpdr.lora.gemm_choice` (kernel or
torch, measured; the kernel's prefetch), :mod:`~scpdr.lora.runner` (:class:`StackedLoRA`, the
runner of :mod:`scpdr.runtime.runner`; it never imports ``ProtectedLM``),
:mod:`~scpdr.lora.loading` (detection at bundle load; :func:`pack_full_model`, a general-path
model loaded from a GGUF file decoding from its Q4_1 blocks on the kernel), :mod:`~scpdr.lora.mapped` (whether a
module's weight is still the checkpoint's mapped bytes, told without paging it in).
"""

from __future__ import annotations

from scpdr.kernels.gemm import pack_panels, unpack_panels
from scpdr.lora.adapters import (
    LoraAdapter,
    UnsupportedAdapterError,
    read_lora_adapter,
    save_random_lora,
)
from scpdr.lora.gemm_choice import (
    StackKernel,
    choose_gemm,
    choose_q4,
    choose_stack_kernel,
    choose_torch_rows,
)
from scpdr.lora.layers import (
    CHUNK_IN_FEATURES,
    TRANSPOSED_MAX_ROWS,
    GroupMode,
    PackedEmbedding,
    StackedLoraLinear,
)
from scpdr.lora.loading import (
    ENV_SWITCH,
    CheckpointWeights,
    checkpoint_weight_source,
    fast_path_from_bundle,
    gguf_file,
    pack_full_model,
    stacked_from_bundle,
)
from scpdr.lora.runner import LoraGroupView, StackedLoRA, new_stacked_cache

__all__ = [
    "CHUNK_IN_FEATURES",
    "ENV_SWITCH",
    "TRANSPOSED_MAX_ROWS",
    "CheckpointWeights",
    "GroupMode",
    "LoraAdapter",
    "LoraGroupView",
    "PackedEmbedding",
    "StackKernel",
    "StackedLoRA",
    "StackedLoraLinear",
    "UnsupportedAdapterError",
    "checkpoint_weight_source",
    "choose_gemm",
    "choose_q4",
    "choose_stack_kernel",
    "choose_torch_rows",
    "fast_path_from_bundle",
    "gguf_file",
    "new_stacked_cache",
    "pack_full_model",
    "pack_panels",
    "read_lora_adapter",
    "save_random_lora",
    "stacked_from_bundle",
    "unpack_panels",
]
