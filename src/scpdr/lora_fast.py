"""Shared-base fast path for LoRA constituents (issue 8; paper App. E, Table 6: LoRA fine-tunes).

When every model that :class:`scpdr.protected.ProtectedLM` runs is a PEFT LoRA adapter over one
base model (or that base model itself, e.g. the base of SCP-Δr-b, Alg. 1), the models share all
base weights and differ by low-rank deltas ``ΔW_g = s_g·B_g A_g`` (s_g = α/r, or α/√r with
rsLoRA). Decoding is memory-bound, so instead of G = K (+1) forwards this module runs **one**
forward of the base over a stacked batch of G·B rows (row ``g·B + b`` is row b of model g):

- every ``nn.Linear`` of the base is wrapped by :class:`StackedLoraLinear`; a targeted one holds
  the stacked ``A`` ``(L, in, r)`` and scaled ``B`` ``(L, r, out)`` of the L leading groups that
  carry adapters (the plain-base group, last in SCP-Δr-b, has no delta and costs nothing); its
  input ``(G·B, T, in)`` is viewed as ``(G, B·T, in)`` and the deltas of all groups come from two
  batched matmuls ``bmm(x, A)`` then ``baddbmm(y, ·, B)``, no per-adapter Python loop;
- on CPU in float32 every linear (base matmul of all stacked rows plus the groups' deltas) is
  one call of a C kernel on weights re-laid out once in panels (``resources/packed_gemm.c``,
  :func:`pack_panels`): it streams the weights once for up to 6 rows and runs 24 rows near the
  core's peak, 2x faster than torch's sgemm here; a tied input embedding is then looked up in
  the packed head (:class:`PackedEmbedding`). Without a C compiler, or with
  ``SCPDR_GEMM_KERNEL=0``, torch's matmuls are used (:meth:`StackedLoraLinear._base_forward`;
  ``docs/lora_fast_path.md``);
- different ranks are zero-padded to the largest (exact: padded rows/columns add 0); modules that
  only some adapters target get zero matrices for the others;
- one KV cache (:func:`new_stacked_cache`) holds the stacked batch; dropping finished rows selects
  the same rows in every group;
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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from scpdr import _kernel

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

    from scpdr.models import BundleManifest

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_IN_FEATURES",
    "ENV_SWITCH",
    "PANEL",
    "TRANSPOSED_MAX_ROWS",
    "LoraAdapter",
    "LoraGroupView",
    "PackedEmbedding",
    "StackedLoRA",
    "StackedLoraLinear",
    "UnsupportedAdapterError",
    "checkpoint_weight_source",
    "fast_path_from_bundle",
    "new_stacked_cache",
    "pack_panels",
    "read_lora_adapter",
    "save_random_lora",
    "stacked_from_bundle",
    "unpack_panels",
]

#: Environment variable: set to "0" to turn the fast path off (the general path is then used).
ENV_SWITCH = "SCPDR_LORA_FAST"

#: Row counts (stacked batch x tokens) up to which the base matmul of a wrapped linear runs as
#: ``(W·xᵀ)ᵀ`` on CPU (see :meth:`StackedLoraLinear._base_forward`).
TRANSPOSED_MAX_ROWS = 6
#: Input width of one weight chunk in the few-rows CPU kernel (wider linears are split).
CHUNK_IN_FEATURES = 576

_PREFIX = "base_model.model."
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: adapter_config.json fields that do not change the inference forward of a plain LoRA (init
#: schemes, target selection, bookkeeping). Any other field with a non-empty value means a
#: variant this module does not implement (DoRA, biases, modules_to_save, ...): fall back.
_NEUTRAL_FIELDS = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "r",
        "target_modules",
        "exclude_modules",
        "lora_alpha",
        "lora_dropout",  # identity at inference
        "use_rslora",
        "init_lora_weights",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",  # ranks are read from the weight shapes
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "runtime_config",
        "qalora_group_size",
        "bias",  # checked separately: only "none"
    }
)


class UnsupportedAdapterError(ValueError):
    """The models cannot share one stacked forward; the message says why (logged, then the
    general path is used)."""


# --------------------------------------------------------------------------------------------
# reading adapters


@dataclass(frozen=True)
class LoraAdapter:
    """One PEFT LoRA adapter read from disk.

    ``modules`` maps a module path of the base model (e.g. ``model.layers.0.self_attn.q_proj``)
    to ``(A (r, in), B (out, r), scaling)``; ``extra`` holds full tensors the adapter stores
    besides A/B (PEFT saves ``lm_head``/``embed_tokens`` weights when they are targets), which
    must equal the base's; ``base_ref`` is the resolved base ref (``scpdr.models`` kinds).
    """

    path: Path
    base_ref: str
    modules: dict[str, tuple[Tensor, Tensor, float]]
    extra: dict[str, Tensor]


def read_lora_adapter(path: str | os.PathLike[str]) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.*``).

    Raises :class:`UnsupportedAdapterError` naming the feature when the adapter is not a plain
    LoRA this module can stack (see the module docstring), FileNotFoundError when files are
    missing.
    """
    from scpdr.models import adapter_base_ref

    d = Path(os.fspath(path))
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise UnsupportedAdapterError(f"{d} is not a PEFT adapter (no adapter_config.json)")
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    peft_type = str(cfg.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"{d} is a {peft_type or 'unknown'} adapter, not LoRA")
    if cfg.get("bias", "none") != "none":
        raise UnsupportedAdapterError(f"{d} trains biases (bias={cfg['bias']!r})")
    odd = sorted(
        k for k, v in cfg.items() if k not in _NEUTRAL_FIELDS and v not in (None, False, {}, [])
    )
    if odd:
        raise UnsupportedAdapterError(
            f"{d} uses LoRA options the fast path does not implement: "
            + ", ".join(f"{k}={cfg[k]!r}" for k in odd)
        )
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _load_adapter_tensors(d)
    a: dict[str, Tensor] = {}
    b: dict[str, Tensor] = {}
    extra: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if not key.startswith(_PREFIX):
            raise UnsupportedAdapterError(f"{d}: unexpected tensor {key!r}")
        name = key[len(_PREFIX) :]
        if name.endswith(".lora_A.weight"):
            a[name[: -len(".lora_A.weight")]] = t
        elif name.endswith(".lora_B.weight"):
            b[name[: -len(".lora_B.weight")]] = t
        elif name.endswith(".weight") and ".lora_" not in name and t.ndim == 2:
            # a full base weight PEFT saves for lm_head / embed_tokens targets
            extra[name[: -len(".weight")].removesuffix(".base_layer")] = t
        else:
            raise UnsupportedAdapterError(
                f"{d}: tensor {key!r} is not a LoRA A/B matrix (DoRA magnitude, embedding LoRA, "
                "bias or trainable tokens)"
            )
    if set(a) != set(b):
        raise UnsupportedAdapterError(f"{d}: unpaired LoRA matrices {sorted(set(a) ^ set(b))}")
    modules: dict[str, tuple[Tensor, Tensor, float]] = {}
    for name in sorted(a):
        ma, mb = a[name], b[name]
        if ma.ndim != 2 or mb.ndim != 2 or ma.shape[0] != mb.shape[1]:
            raise UnsupportedAdapterError(
                f"{d}: {name} has A {tuple(ma.shape)} and B {tuple(mb.shape)}, not a LoRA pair"
            )
        r = ma.shape[0]
        modules[name] = (ma, mb, alpha / math.sqrt(r) if rslora else alpha / r)
    if not modules:
        raise UnsupportedAdapterError(f"{d} holds no LoRA matrices")
    return LoraAdapter(d, adapter_base_ref(d), modules, extra)


def _load_adapter_tensors(d: Path) -> dict[str, Tensor]:
    for fname in _WEIGHT_FILES:
        f = d / fname
        if f.is_file():
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(f))
            return torch.load(str(f), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{d} has no adapter weights ({' or '.join(_WEIGHT_FILES)})")


# --------------------------------------------------------------------------------------------
# the stacked model


class _Mode:
    """Which rows the wrapped linears see: ``stacked`` = G groups stacked along the batch;
    ``single`` = one group's rows only (None: the plain base, no delta)."""

    def __init__(self) -> None:
        self.stacked: int | None = None
        self.single: int | None = None


def _in_chunks(in_features: int) -> int:
    """Chunks for the CPU base matmul of a wide linear: the smallest ``c`` dividing
    ``in_features`` with chunks of at most :data:`CHUNK_IN_FEATURES` (1: no split)."""
    if in_features <= CHUNK_IN_FEATURES:
        return 1
    for c in range(2, in_features // 64 + 1):
        if in_features % c == 0 and in_features // c <= CHUNK_IN_FEATURES:
            return c
    return 1


def _packs(kernel: Any | None, layer: nn.Linear) -> bool:
    """Whether ``layer`` runs on the packed kernel (loaded, and a float32 CPU weight)."""
    return kernel is not None and _packable(layer.weight)


def _packable(w: Tensor) -> bool:
    """Whether the packed CPU kernel can run a linear with weight ``w`` (float32 on CPU)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def _source_weight(
    source: Callable[[str], Tensor | None] | None, name: str, layer: nn.Linear, *, packed: bool
) -> Tensor | None:
    """``layer``'s weight from ``source`` when it will be re-laid out (``packed``, or a wide
    linear chunked on CPU; else None). Checked against the module (shape, dtype kind, first,
    middle and last rows): anything odd, e.g. weights converted at load time, means None (the
    module's own weight is used)."""
    w = layer.weight
    relaid = packed or _in_chunks(layer.in_features) > 1
    if source is None or w.device.type != "cpu" or not relaid:
        return None
    try:
        src = source(name)
    except Exception as exc:  # a broken checkpoint: the module's weight is correct anyway
        logger.debug("weight source failed for %s: %s", name, exc)
        return None
    if src is None or src.shape != w.shape or not src.dtype.is_floating_point:
        return None
    rows = [0, w.shape[0] // 2, w.shape[0] - 1]
    if not torch.equal(src[rows].to(w.dtype), w.detach()[rows]):
        return None
    return src


#: Output columns per panel of the packed weight layout (``NR`` in ``resources/packed_gemm.c``).
PANEL = 64


def pack_panels(w: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``W (n, k)`` of ``y = x·Wᵀ`` laid out for the packed CPU kernel: float32 panels
    ``(ceil(n / PANEL), k, PANEL)``, panel p holding ``W[p·PANEL : (p + 1)·PANEL]ᵀ`` (columns past
    n are zero, which adds exact zeros). Written without an intermediate padded copy, into
    ``out`` when given (zero-filled, at least that many panels; the panels past n are left)."""
    n, k = w.shape
    full, rest = divmod(n, PANEL)
    if out is None:
        out = torch.zeros(full + (rest > 0), k, PANEL, dtype=torch.float32)
    w = w.detach()
    if full:
        out[:full].copy_(w[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if rest:
        out[full, :, :rest].copy_(w[full * PANEL :].t())
    return out


def unpack_panels(packed: Tensor, n: int) -> Tensor:
    """The inverse of :func:`pack_panels`: ``W (n, k)`` (a copy)."""
    p, k, width = packed.shape
    return packed.transpose(1, 2).reshape(p * width, k)[:n]


class PackedEmbedding(nn.Module):
    """Input embeddings looked up in the packed output head they were tied to (SmolLM2 ties
    them): row v of ``W`` is column ``v % PANEL`` of panel ``v // PANEL``. Replaces a tied
    ``nn.Embedding`` in the fast path so that the model's original matrix, a second
    vocab x hidden copy, is never paged in."""

    def __init__(self, head: StackedLoraLinear, like: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "_head", head)  # not a submodule: registered once, as the head
        self.num_embeddings, self.embedding_dim = like.num_embeddings, like.embedding_dim
        self.padding_idx = like.padding_idx

    @property
    def weight(self) -> Tensor:
        """The embedding matrix ``(vocab, hidden)`` (a copy)."""
        return self._head.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.numel():
            lo, hi = torch.aminmax(input_ids)
            if lo < 0 or hi >= self.num_embeddings:  # nn.Embedding's error, not a padded panel
                raise IndexError(
                    f"token ids must be in [0, {self.num_embeddings}), got {int(lo)}..{int(hi)}"
                )
        packed = self._head.weight_packed
        return packed[input_ids // PANEL, :, input_ids % PANEL]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed (tied to the output head)"


class StackedLoraLinear(nn.Module):
    """An ``nn.Linear`` of the shared base plus the LoRA deltas of L groups.

    Stacked mode (G groups, input ``(G·B, T, in)``): the base output ``y = x·Wᵀ (+ bias)`` for all
    rows, then for the first L groups ``y_g += (x_g·A_gᵀ)·(s_g·B_g)ᵀ`` with two batched matmuls.
    Single mode (group g): ``y + (x·A_gᵀ)·(s_g·B_g)ᵀ``. Groups ``>= L`` have no delta.

    With ``kernel`` (the library of :func:`scpdr._kernel.packed_gemm_kernel`) and a float32 CPU
    weight, everything runs in the C kernel on panels (:func:`pack_panels`): buffers
    ``weight_packed`` ``(ceil(out/64), in, 64)``, ``lora_a_packed`` ``(L, ceil(r/64), in, 64)``
    (A) and ``lora_b_packed`` ``(L, ceil(out/64), r, 64)`` (s·B), given already packed with
    ``lora_packed=True``; ``base_layer`` is dropped. Otherwise (torch's matmuls): ``lora_a``
    ``(L, in, r)`` (= Aᵀ), ``lora_b`` ``(L, r, out)`` (= s·Bᵀ), and on CPU a linear wider than
    :data:`CHUNK_IN_FEATURES` inputs keeps its weight as ``c`` input chunks ``weight_chunks``
    ``(c, out, in/c)`` instead of ``base_layer`` (see :meth:`_base_forward`). The LoRA buffers
    are None (L = 0) for a linear no adapter targets (wrapped for the stacked base matmul only).
    None of the buffers is persistent. ``source``: the weight read from the checkpoint, used for
    the re-laid-out copy so that the model's own (memory-mapped) one is never paged in.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        a: Tensor | None,
        b: Tensor | None,
        mode: _Mode,
        *,
        source: Tensor | None = None,
        kernel: Any | None = None,
        lora_packed: bool = False,
    ) -> None:
        super().__init__()
        self._in, self._out = base_layer.in_features, base_layer.out_features
        w = base_layer.weight
        # only whether to pack: the library itself is fetched at each call (a module holding a
        # ctypes handle could not be copied or pickled)
        packs = _packs(kernel, base_layer)
        if lora_packed and not packs:
            raise ValueError("packed LoRA matrices need the packed kernel and a float32 CPU layer")
        self.rank = 0 if b is None else int(b.shape[-2])  # b: (L, r, out) or (L, ., r, PANEL)
        self.num_lora = 0 if a is None else int(a.shape[0])
        self._mode = mode
        c = _in_chunks(self._in) if w.device.type == "cpu" else 1
        # ``source``: the same weight read from the checkpoint, so that the model's own
        # (memory-mapped) copy is never paged in when the weight is re-laid out
        src = (w if source is None else source.to(w.dtype)).detach()
        packed = chunks = None
        if packs:  # panels for resources/packed_gemm.c, built once
            packed = pack_panels(src)
            if a is not None and not lora_packed:  # a (L, in, r) = A_gᵀ, b (L, r, out) = s·B_gᵀ
                a = torch.stack([pack_panels(t.t()) for t in a])
                b = torch.stack([pack_panels(t.t()) for t in b])
        elif c > 1:  # (c, out, in/c) chunks
            chunks = src.view(self._out, c, self._in // c).permute(1, 0, 2).contiguous()
        relaid = packed is not None or chunks is not None
        self.base_layer = None if relaid else base_layer  # a re-laid-out original is dropped
        bias = None if not relaid or base_layer.bias is None else base_layer.bias.detach()
        for name, t in (
            ("weight_packed", packed),
            ("weight_chunks", chunks),
            ("bias", bias),
            ("lora_a_packed", a if packs else None),
            ("lora_b_packed", b if packs else None),
            ("lora_a", None if packs else a),
            ("lora_b", None if packs else b),
        ):
            self.register_buffer(name, t, persistent=False)

    @property
    def weight(self) -> Tensor:
        """The base weight ``(out, in)`` (so ``get_output_embeddings().weight`` still works; a
        copy for a chunked weight)."""
        if self.base_layer is not None:
            return self.base_layer.weight
        if self.weight_packed is not None:
            return unpack_panels(self.weight_packed, self._out)
        return self.weight_chunks.permute(1, 0, 2).reshape(self._out, self._in)

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def out_features(self) -> int:
        return self._out

    def _base_forward(self, x: Tensor) -> Tensor:
        """``x·Wᵀ + bias`` ``(N, ..., out)``, a fresh contiguous tensor.

        CPU kernels (MKL, measured in ``docs/lora_fast_path.md``): for 2..TRANSPOSED_MAX_ROWS
        rows ``F.linear`` picks a small-M sgemm costing ~2x one row, while ``(W·xᵀ)ᵀ`` streams W
        once for all rows, as fast as one row when W has at most ~576 inputs; wider weights are
        split into input chunks of that size (one bmm, summed). With many rows, ``F.linear``.
        """
        rows = x.numel() // x.shape[-1]
        few = 1 < rows <= TRANSPOSED_MAX_ROWS and x.device.type == "cpu"
        w3 = self.weight_chunks
        if w3 is None:
            layer = self.base_layer
            if not few:
                return layer(x)
            y = torch.mm(layer.weight, x.reshape(rows, -1).t()).t()  # (rows, out), a view
            bias = layer.bias
        else:
            c, _, k = w3.shape
            x2 = x.reshape(rows, c * k)
            if rows == 1 or few:  # (c, out, k) @ (c, k, rows), summed over the chunks
                y = torch.bmm(w3, x2.t().reshape(c, k, rows)).sum(0).t()
            else:  # (c, rows, k) @ (c, k, out)
                y = torch.bmm(x2.view(rows, c, k).transpose(0, 1), w3.transpose(1, 2)).sum(0)
            bias = self.bias
        if bias is not None:
            y = y + bias
        return y.contiguous().view(*x.shape[:-1], self._out)

    def _groups(self) -> tuple[int, int, int]:
        """``(G, first, L)``: the input holds G groups of rows; groups ``first .. first + L - 1``
        of the adapters apply to the first L of them."""
        mode, n = self._mode, self.num_lora
        if mode.stacked is not None:
            return mode.stacked, 0, min(n, mode.stacked)
        if mode.single is not None and mode.single < n:
            return 1, mode.single, 1
        return 1, 0, 0

    def _packed_forward(self, x: Tensor) -> Tensor:
        """:meth:`forward` on the packed layout: one call of ``scpdr_lora_linear_f32`` for the
        base matmul of all rows and the deltas of the groups with adapters; the torch reference
        :meth:`_packed_reference` when autograd needs a graph, the input is not float32 on CPU
        (e.g. autocast, or a model moved to another device after packing), or the kernel was
        switched off after packing."""
        k, n = self._in, self._out
        rows = x.numel() // k
        g, first, lora = self._groups()
        if rows % g:
            raise ValueError(f"{rows} input rows do not split into {g} stacked groups")
        w = self.weight_packed
        lib = _kernel.packed_gemm_kernel()  # cached; None if switched off since
        if (
            lib is None
            or (torch.is_grad_enabled() and x.requires_grad)
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or w.device.type != "cpu"
            or w.dtype != torch.float32
        ):
            x2 = x.reshape(rows, k).to(w.dtype)
            y = self._packed_reference(x2.to(w.device), g, first, lora).to(x.device, x.dtype)
        else:
            x2 = x.reshape(rows, k).contiguous()
            y = torch.empty(rows, n, dtype=torch.float32)
            per = rows // g
            a_ptr = b_ptr = tmp_ptr = None
            if lora:
                width = self.lora_a_packed.shape[1] * PANEL
                tmp = torch.empty(lora, per, width, dtype=torch.float32)
                a_ptr = self.lora_a_packed[first].data_ptr()
                b_ptr = self.lora_b_packed[first].data_ptr()
                tmp_ptr = tmp.data_ptr()
            lib.scpdr_lora_linear_f32(
                g, per, n, k, x2.data_ptr(), self.weight_packed.data_ptr(), lora, self.rank,
                a_ptr, b_ptr, tmp_ptr, y.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], n)

    def _packed_reference(self, x2: Tensor, g: int, first: int, lora: int) -> Tensor:
        """The packed forward in torch ops (differentiable; the slow reference of the tests)."""
        y = x2 @ unpack_panels(self.weight_packed, self._out).t()
        if not lora:
            return y
        ys = list(y.view(g, -1, self._out).unbind(0))
        xs = x2.view(g, -1, self._in)
        for j in range(lora):
            a = unpack_panels(self.lora_a_packed[first + j], self.rank)  # (r, in) = A
            b = unpack_panels(self.lora_b_packed[first + j], self._out)  # (out, r) = s·B
            ys[j] = ys[j] + (xs[j] @ a.t()) @ b.t()
        return torch.cat(ys, 0)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_packed is not None:
            return self._packed_forward(x)
        y = self._base_forward(x)  # (N, ..., out), a fresh tensor
        mode, n = self._mode, self.num_lora
        if n == 0:
            return y
        if mode.stacked is not None:
            g = mode.stacked
            xs = x.reshape(g, -1, x.shape[-1])[:n]  # (L, B·T, in)
            ys = y.view(g, -1, y.shape[-1])  # (G, B·T, out), aliases y
            ys[:n].baddbmm_(torch.bmm(xs, self.lora_a), self.lora_b)
            return y
        if mode.single is not None and mode.single < n:
            i = mode.single
            return y + (x @ self.lora_a[i]) @ self.lora_b[i]
        return y

    def extra_repr(self) -> str:
        kernel = "packed" if self.weight_packed is not None else "torch"
        return f"groups_with_lora={self.num_lora}, rank={self.rank}, kernel={kernel}"


@functools.lru_cache(maxsize=1)
def _stacked_cache_class() -> type:
    from transformers import DynamicCache

    class StackedCache(DynamicCache):
        """A ``DynamicCache`` whose batch holds G groups of B rows (row ``g·B + b``):
        ``batch_select_indices(idx)``, with indices among the B rows, keeps them in every group."""

        def __init__(self, groups: int) -> None:
            super().__init__()
            self.groups = groups

        def batch_select_indices(self, indices: Tensor) -> None:
            live = [x for x in self.layers if getattr(x, "keys", None) is not None]
            if not live or live[0].keys.numel() == 0:
                return
            rows = live[0].keys.shape[0] // self.groups
            idx = indices.to(live[0].keys.device).long()
            offs = torch.arange(self.groups, device=idx.device).unsqueeze(1) * rows  # (G, 1)
            super().batch_select_indices((offs + idx.unsqueeze(0)).reshape(-1))  # (G·B',)

    return StackedCache


def new_stacked_cache(groups: int) -> Any:
    """An empty KV cache for a batch of ``groups`` stacked groups (a ``DynamicCache`` subclass
    whose ``batch_select_indices`` selects the same rows in every group)."""
    return _stacked_cache_class()(groups)


class LoraGroupView(nn.Module):
    """Group ``g`` of a :class:`StackedLoRA` as a causal LM of its own (the base with adapter g,
    or the plain base): ``forward(**kw)`` runs the shared base in single-group mode, so it gives
    the merged model's outputs. ProtectedLM holds these as its constituents/base (vocabulary,
    device and generation-config checks); the fast path never calls them."""

    def __init__(self, stack: StackedLoRA, group: int, name: str) -> None:
        super().__init__()
        self.model = stack.model  # shared: parameters() and .to() see the base's
        self.group = group
        self.name = name
        object.__setattr__(self, "_stack", stack)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._stack._single(self.group):
            return self.model(*args, **kwargs)


class StackedLoRA:
    """One base model and G groups (LoRA adapters over it, or the base itself) run as one
    stacked batch. ``__call__`` returns every group's logits; ``views`` are the groups as models.

    Args:
        model: the shared base (its targeted ``nn.Linear`` modules get wrapped in place; pass a
            model that nothing else uses).
        groups: one entry per group, in ProtectedLM's run order (constituents, then the base
            for SCP-Δr-b): a :class:`LoraAdapter` or None (the plain base).
        names: a name per group (for logs and views).
        weight_source: optional ``module name -> weight tensor | None`` reading a base weight
            from the checkpoint (see :func:`checkpoint_weight_source`): weights that are
            re-laid out (wide linears on CPU) are copied from there, so that the model's own
            memory-mapped copy is never paged in (peak memory as one model).
        use_kernel: run float32 CPU linears with the packed C kernel
            (:func:`scpdr._kernel.packed_gemm_kernel`) when it builds here; False (or
            ``SCPDR_GEMM_KERNEL=0``) keeps torch's matmuls (same results up to rounding).
        release_adapters: empty the adapters' ``LoraAdapter.modules`` once their matrices are
            copied into the stack, before the base weights are re-laid out (peak memory then
            holds one copy of the adapters instead of two). :func:`stacked_from_bundle` does, for
            the adapters it read.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        groups: Sequence[LoraAdapter | None],
        names: Sequence[str],
        *,
        weight_source: Callable[[str], Tensor | None] | None = None,
        use_kernel: bool = True,
        release_adapters: bool = False,
    ) -> None:
        groups = list(groups)
        if len(groups) != len(names):
            raise ValueError("one name per group")
        if not any(g is not None for g in groups):
            raise UnsupportedAdapterError("no group carries a LoRA adapter")
        self.model = model
        self.num_groups = len(groups)
        self.names = list(names)
        # groups >= L carry no delta (the plain base is last in SCP-Δr-b)
        self.num_lora = 1 + max(i for i, g in enumerate(groups) if g is not None)
        self._mode = _Mode()
        self._release = release_adapters
        self._wrap(groups, weight_source, use_kernel)
        self.views = [LoraGroupView(self, i, n) for i, n in enumerate(self.names)]

    def _wrap(
        self,
        groups: list[LoraAdapter | None],
        weight_source: Callable[[str], Tensor | None] | None,
        use_kernel: bool,
    ) -> None:
        targets = sorted({name for g in groups if g is not None for name in g.modules})
        named = dict(self.model.named_modules())
        plans: list[tuple[str, nn.Linear, int]] = []  # (name, layer, rank); 0: no adapter
        for name in targets:  # checked before anything is modified
            layer = named.get(name)
            if layer is None:
                raise UnsupportedAdapterError(f"the base model has no module {name!r}")
            if type(layer) is not nn.Linear:
                raise UnsupportedAdapterError(
                    f"adapted module {name!r} is a {type(layer).__name__}, not an nn.Linear"
                )
            for g in groups:
                if g is not None and name in g.modules:
                    a_shape, b_shape = (tuple(t.shape) for t in g.modules[name][:2])
                    if a_shape[1] != layer.in_features or b_shape[0] != layer.out_features:
                        raise UnsupportedAdapterError(
                            f"{g.path}: {name} has A {a_shape}, B {b_shape}, but the base layer "
                            f"is {layer.out_features}x{layer.in_features}"
                        )
            rank = max(g.modules[name][0].shape[0] for g in groups if g and name in g.modules)
            plans.append((name, layer, rank))
        for g in groups:
            if g is None:
                continue
            for name, t in g.extra.items():
                layer = named.get(name)
                w = getattr(layer, "weight", None)
                if (
                    w is None
                    or w.shape != t.shape
                    or not torch.equal(w.detach().cpu(), t.to(w.dtype))
                ):
                    raise UnsupportedAdapterError(
                        f"{g.path} stores its own {name} weights (a resized or trained vocabulary)"
                    )
        others = [  # the other linears (lm_head...): wrapped for the stacked base matmul only
            (name, layer, 0)
            for name, layer in named.items()
            if type(layer) is nn.Linear and name not in targets
        ]
        kernel = _kernel.packed_gemm_kernel() if use_kernel else None
        emb = self.model.get_input_embeddings()
        emb_weight = getattr(emb, "weight", None)
        emb_name = next((n for n, mod in named.items() if mod is emb), None)
        tied_head: StackedLoraLinear | None = None
        # Only now modify the model. The adapters' matrices first, then (release_adapters) the
        # adapters' own tensors go: they share one memory map per file, freed only with the last.
        matrices = {
            name: self._lora_matrices(groups, name, layer, rank, _packs(kernel, layer))
            for name, layer, rank in plans
        }
        if self._release:
            for g in groups:
                if g is not None:
                    g.modules.clear()
        # the largest weights first, so that the transient copy read from the checkpoint (the
        # head: vocab x hidden) comes before the packed weights pile up
        order = [n for n, _, _ in sorted(plans + others, key=lambda p: -p[1].weight.numel())]
        del named, plans, others  # each original layer is freed as soon as it is replaced
        for name in order:
            layer = self.model.get_submodule(name)
            packed = _packs(kernel, layer)
            # a head tied to the input embeddings is read from the checkpoint under their name
            tied = emb_weight is not None and layer.weight is emb_weight
            source = _source_weight(
                weight_source, emb_name if tied and emb_name else name, layer, packed=packed
            )
            a, b = matrices.pop(name, (None, None))
            wrapped = StackedLoraLinear(
                layer, a, b, self._mode, source=source, kernel=kernel, lora_packed=packed
            )
            self.model.set_submodule(name, wrapped)
            if tied and wrapped.weight_packed is not None:
                tied_head = wrapped
        if tied_head is not None and type(emb) is nn.Embedding and emb.max_norm is None:
            # look the embeddings up in the packed head: the original is never paged in
            self.model.set_input_embeddings(PackedEmbedding(tied_head, emb))

    def _lora_matrices(
        self, groups: list[LoraAdapter | None], name: str, layer: nn.Linear, rank: int, packed: bool
    ) -> tuple[Tensor, Tensor]:
        """The deltas of module ``name`` for the first L groups, ranks below ``rank`` and groups
        without it zero-padded (exact): ``Aᵀ (L, in, r)`` and ``s·Bᵀ (L, r, out)``, or with
        ``packed`` the panels of ``A`` ``(L, ceil(r / PANEL), in, PANEL)`` and of ``s·B``
        ``(L, ceil(out / PANEL), r, PANEL)`` written directly (no intermediate copy)."""
        n_in, n_out, lora = layer.in_features, layer.out_features, self.num_lora
        if packed:
            a = torch.zeros(lora, -(-rank // PANEL), n_in, PANEL, dtype=torch.float32)
            b = torch.zeros(lora, -(-n_out // PANEL), rank, PANEL, dtype=torch.float32)
        else:
            a = torch.zeros(lora, n_in, rank, dtype=torch.float32)
            b = torch.zeros(lora, rank, n_out, dtype=torch.float32)
        for i, g in enumerate(groups[:lora]):
            if g is None or name not in g.modules:
                continue
            ma, mb, scale = g.modules[name]
            k = ma.shape[0]
            if packed:
                pack_panels(ma.float(), out=a[i])
                pack_panels(mb.float() * scale, out=b[i, :, :k])
            else:
                a[i, :, :k] = ma.float().t()
                b[i, :k, :] = (mb.float() * scale).t()
        w = layer.weight
        return (a, b) if packed else (a.to(w.device, w.dtype), b.to(w.device, w.dtype))

    @contextlib.contextmanager
    def _single(self, group: int) -> Iterator[None]:
        old = (self._mode.stacked, self._mode.single)
        self._mode.stacked, self._mode.single = None, group
        try:
            yield
        finally:
            self._mode.stacked, self._mode.single = old

    @contextlib.contextmanager
    def _stacked(self) -> Iterator[None]:
        old = (self._mode.stacked, self._mode.single)
        self._mode.stacked, self._mode.single = self.num_groups, None
        try:
            yield
        finally:
            self._mode.stacked, self._mode.single = old

    #: The runner protocol (``scpdr.runtime.runner.ModelRunner``): one forward of the shared base
    #: serves every group.
    shared_base = True

    @property
    def models(self) -> list[LoraGroupView]:
        """The groups as models, in run order (the runner protocol's ``models``): a
        ``ProtectedLM`` holds them as its constituents (and base, last, for SCP-Δr-b); build one
        with ``scpdr.runtime.ProtectedLM.from_runner(stack, tokenizer, method=...)``."""
        return self.views

    def new_caches(self) -> list[Any]:
        """One KV cache for the stacked batch (a list, as the runner protocol returns them)."""
        return [new_stacked_cache(self.num_groups)]

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        caches: list[Any] | None = None,
        keep: int | Tensor = 0,
    ) -> Tensor:
        """One forward of all groups (the runner protocol, ``scpdr.runtime.runner``):
        ``input_ids``/``attention_mask``/``position_ids`` ``(B, T)`` → float32 logits
        ``(G, B, T', V)`` (T' = ``keep`` or T when ``keep`` is an int), or the positions a
        ``keep`` tensor selects (``scpdr.runtime.runner.index_positions``). ``caches`` is one of
        :meth:`new_caches` (or None: no cache)."""
        from scpdr.runtime.runner import index_positions

        g, bsz = self.num_groups, input_ids.shape[0]
        cache = None if caches is None else caches[0]
        kwargs: dict[str, Any] = (
            {"past_key_values": cache, "use_cache": True}
            if cache is not None
            else {"use_cache": False}
        )
        with self._stacked():
            out = self.model(
                input_ids=input_ids.repeat(g, 1),  # (G·B, T), row g·B + b
                attention_mask=attention_mask.repeat(g, 1),
                position_ids=position_ids.repeat(g, 1),
                logits_to_keep=keep if isinstance(keep, int) else 0,
                **kwargs,
            )
        logits = out.logits.float()  # (G·B, T', V)
        logits = logits.view(g, bsz, *logits.shape[1:])
        return logits if isinstance(keep, int) else index_positions(logits, keep)


def checkpoint_weight_source(model_dir: str | os.PathLike[str]) -> Callable[[str], Tensor | None]:
    """``module name -> its weight`` read from the safetensors checkpoint in ``model_dir``
    (``model.safetensors`` or a sharded index), or None when absent. Each call opens its file
    with its own memory map, released once the returned tensor is dropped."""
    d = Path(os.fspath(model_dir))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = {k: d / v for k, v in weight_map.items()}
    else:
        files = None

    def read(name: str) -> Tensor | None:
        from safetensors import safe_open

        key = f"{name}.weight"
        f = files.get(key) if files is not None else d / "model.safetensors"
        if f is None or not f.is_file():
            return None
        with safe_open(str(f), framework="pt") as fh:
            return fh.get_tensor(key) if key in fh.keys() else None

    return read


# --------------------------------------------------------------------------------------------
# detection at bundle load


def _canonical(ref: str) -> str:
    from scpdr.models import EMBEDDED, base_model_dir

    if ref == EMBEDDED:
        return str(base_model_dir().resolve())
    return str(Path(ref).resolve())


def stacked_from_bundle(
    path: str | os.PathLike[str],
    manifest: BundleManifest,
    *,
    method: str,
    base: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> StackedLoRA | None:
    """The fast path for a bundle, or None (general path) with the reason logged at INFO; see
    :func:`fast_path_from_bundle`."""
    return fast_path_from_bundle(
        path, manifest, method=method, base=base, dtype=dtype, device=device
    )[0]


def fast_path_from_bundle(
    path: str | os.PathLike[str],
    manifest: BundleManifest,
    *,
    method: str,
    base: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[StackedLoRA | None, str]:
    """``(stack, why)``: the fast path for a bundle, or ``(None, why not)`` (the general path);
    the reason is also logged at INFO.

    Groups, in the runtime's run order: the constituents (all for every method but "none"),
    then the bundle's base when the method is an SCP rule with ``base="model"`` (variant 'b').
    Each group must be a LoRA adapter over one common base or that base itself.
    """
    from scpdr import methods
    from scpdr.models import load_model, ref_kind

    def off(reason: str) -> tuple[None, str]:
        logger.info("LoRA fast path off for bundle %s: %s; using the general path", path, reason)
        return None, reason

    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return off(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if method == "none":
        return off("method 'none' runs one model (the merged adapter is as fast)")
    scp_b = method in methods.SMOOTHED_RULES and base == "model"
    if scp_b and manifest.base is None:
        return off("the bundle has no base model")
    refs = [manifest.resolve(path, r) for r in manifest.constituents]
    names = list(manifest.constituents)
    if scp_b:
        refs.append(manifest.resolve(path, str(manifest.base)))
        names.append("base")
    adapters: list[LoraAdapter | None] = []
    for ref, name in zip(refs, names, strict=True):
        try:
            kind = ref_kind(ref)
        except FileNotFoundError as exc:
            return off(str(exc))
        if kind != "peft":
            adapters.append(None)  # must be the common base itself (checked below)
            continue
        try:
            adapters.append(read_lora_adapter(ref))
        except (UnsupportedAdapterError, FileNotFoundError) as exc:
            return off(f"{name}: {exc}")
    bases = {_canonical(a.base_ref) for a in adapters if a is not None}
    if not bases:
        return off("no constituent is a LoRA adapter")
    if len(bases) > 1:
        return off(f"the adapters have different base models ({', '.join(sorted(bases))})")
    common = next(iter(bases))
    for ref, name, a in zip(refs, names, adapters, strict=True):
        if a is None and _canonical(ref) != common:
            return off(f"{name} ({ref}) is a full model, not a LoRA adapter over {common}")
    model = load_model(common, dtype=dtype)
    if device is not None:
        model = model.to(device)
    source = checkpoint_weight_source(common) if Path(common).is_dir() else None
    try:
        stack = StackedLoRA(model, adapters, names, weight_source=source, release_adapters=True)
    except UnsupportedAdapterError as exc:
        return off(str(exc))
    why = (
        f"{stack.num_groups} groups ({sum(a is not None for a in adapters)} with LoRA adapters) "
        f"over {common} in one forward"
    )
    logger.info("LoRA fast path on for bundle %s: %s", path, why)
    return stack, why


# --------------------------------------------------------------------------------------------
# building adapters (tests, benchmarks, smoke runs)


def save_random_lora(
    base_model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    *,
    base_ref: str,
    r: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    std: float = 0.05,
    use_rslora: bool = False,
) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B over ``base_model`` into
    ``out_dir`` (a real ``PeftModel.save_pretrained`` directory), and return it.

    ``base_ref`` is written as ``base_model_name_or_path`` (a path relative to ``out_dir``, an
    absolute path, or "embedded"). Every A and B entry is drawn from N(0, ``std``²) with
    ``seed`` (PEFT initializes B to zero, which would make the delta vanish); dropout is 0.
    ``base_model`` is not modified (a deep copy is adapted).
    """
    import copy
    import warnings

    from peft import LoraConfig, get_peft_model

    out = Path(os.fspath(out_dir))
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # PEFT warns about tied lm_head targets
        warnings.simplefilter("ignore")
        pm = get_peft_model(copy.deepcopy(base_model), cfg)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
                if ".lora_A." in name or ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        pm.save_pretrained(str(out))
    cfg_file = out / "adapter_config.json"
    data = json.loads(cfg_file.read_text(encoding="utf-8"))
    data["base_model_name_or_path"] = base_ref
    from scpdr.io import atomic_write_json

    atomic_write_json(cfg_file, data)
    return out
