"""Shared-base fast path for LoRA constituents (issue 8; paper App. E, Table 6: LoRA fine-tunes).

When every model that :class:`scpdr.protected.ProtectedLM` runs is a PEFT LoRA adapter over one
base model (or that base model itself, e.g. the base of SCP-Δr-b, Alg. 1), the models share all
base weights and differ by low-rank deltas ``ΔW_g = s_g·B_g A_g`` (s_g = α/r, or α/√r with
rsLoRA). Decoding is memory-bound, so instead of G = K (+1) forwards this module runs **one**
forward of the base over a stacked batch of G·B rows (row ``g·B + b`` is row b of model g):

- every ``nn.Linear`` of the base is wrapped by :class:`StackedLoraLinear`
  (:mod:`scpdr.lora_layers`); a targeted one holds the stacked ``A`` ``(L, in, r)`` and scaled
  ``B`` ``(L, r, out)`` of the L leading groups that carry adapters (the plain-base group, last
  in SCP-Δr-b, has no delta and costs nothing); its input ``(G·B, T, in)`` is viewed as ``(G,
  B·T, in)`` and the deltas of all groups come from two batched matmuls ``bmm(x, A)`` then
  ``baddbmm(y, ·, B)``, no per-adapter Python loop;
- on CPU in float32 every linear (base matmul of all stacked rows plus the groups' deltas) is
  one call of a C kernel on weights re-laid out once in panels (``kernels/packed_gemm.c``, a
  register tile per ISA): where :func:`scpdr.lora_layers.choose_gemm` measured it faster than
  torch's sgemm on this machine (2-3x with AVX-512 or AVX2 here); a tied input embedding is
  then looked up in the packed head (:class:`PackedEmbedding`). Otherwise — no C compiler, no
  tile for the ISA, slower here, or ``SCPDR_GEMM_KERNEL=0`` — torch's matmuls are used
  (``docs/lora_fast_path.md``);
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

from scpdr.kernels.gemm import GemmLibrary, pack_panels, unpack_panels
from scpdr.lora_layers import (
    CHUNK_IN_FEATURES,
    TRANSPOSED_MAX_ROWS,
    GroupMode,
    PackedEmbedding,
    StackedLoraLinear,
    choose_gemm,
    packable,
    source_weight,
)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

    from scpdr.models import BundleManifest

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_IN_FEATURES",
    "ENV_SWITCH",
    "TRANSPOSED_MAX_ROWS",
    "GroupMode",
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


def _width(gemm: GemmLibrary | None, layer: nn.Linear) -> int | None:
    """The panel width ``layer`` is packed with (None: it stays on torch's matmuls)."""
    return gemm.panel_width if gemm is not None and packable(layer.weight) else None


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
        use_kernel: run float32 CPU linears with the packed C kernel where it builds and is
            measured faster here (:func:`scpdr.lora_layers.choose_gemm`); False (or
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
        self._mode = GroupMode()
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
        gemm: GemmLibrary | None = None
        if use_kernel:  # the packed kernel, where it is measured faster here (lora_layers)
            packs = [layer for _, layer, _ in plans + others if packable(layer.weight)]
            ranks = {name: rank for name, _, rank in plans}
            shapes = [(layer.in_features, layer.out_features, ranks.get(name, 0))
                      for name, layer, _ in plans + others if packable(layer.weight)]  # fmt: skip
            if packs:
                gemm = choose_gemm(shapes, groups=self.num_groups, lora=self.num_lora)
        emb = self.model.get_input_embeddings()
        emb_weight = getattr(emb, "weight", None)
        emb_name = next((n for n, mod in named.items() if mod is emb), None)
        tied_head: StackedLoraLinear | None = None
        # Only now modify the model. The adapters' matrices first, then (release_adapters) the
        # adapters' own tensors go: they share one memory map per file, freed only with the last.
        matrices = {
            name: self._lora_matrices(groups, name, layer, rank, _width(gemm, layer))
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
            packed = _width(gemm, layer) is not None
            # a head tied to the input embeddings is read from the checkpoint under their name
            tied = emb_weight is not None and layer.weight is emb_weight
            source = source_weight(
                weight_source, emb_name if tied and emb_name else name, layer, packed=packed
            )
            a, b = matrices.pop(name, (None, None))
            wrapped = StackedLoraLinear(
                layer, a, b, self._mode, source=source, gemm=gemm, lora_packed=packed
            )
            self.model.set_submodule(name, wrapped)
            if tied and wrapped.weight_packed is not None:
                tied_head = wrapped
        if tied_head is not None and type(emb) is nn.Embedding and emb.max_norm is None:
            # look the embeddings up in the packed head: the original is never paged in
            self.model.set_input_embeddings(PackedEmbedding(tied_head, emb))

    def _lora_matrices(
        self,
        groups: list[LoraAdapter | None],
        name: str,
        layer: nn.Linear,
        rank: int,
        width: int | None,
    ) -> tuple[Tensor, Tensor]:
        """The deltas of module ``name`` for the first L groups, ranks below ``rank`` and groups
        without it zero-padded (exact): ``Aᵀ (L, in, r)`` and ``s·Bᵀ (L, r, out)``, or with a
        panel ``width`` (the packed kernel's) the panels of ``A`` ``(L, ceil(r / width), in,
        width)`` and of ``s·B`` ``(L, ceil(out / width), r, width)`` written directly (no
        intermediate copy)."""
        n_in, n_out, lora = layer.in_features, layer.out_features, self.num_lora
        if width is not None:
            a = torch.zeros(lora, -(-rank // width), n_in, width, dtype=torch.float32)
            b = torch.zeros(lora, -(-n_out // width), rank, width, dtype=torch.float32)
        else:
            a = torch.zeros(lora, n_in, rank, dtype=torch.float32)
            b = torch.zeros(lora, rank, n_out, dtype=torch.float32)
        for i, g in enumerate(groups[:lora]):
            if g is None or name not in g.modules:
                continue
            ma, mb, scale = g.modules[name]
            k = ma.shape[0]
            if width is not None:
                pack_panels(ma.float(), width, out=a[i])
                pack_panels(mb.float() * scale, width, out=b[i, :, :k])
            else:
                a[i, :, :k] = ma.float().t()
                b[i, :k, :] = (mb.float() * scale).t()
        w = layer.weight
        return (a, b) if width is not None else (a.to(w.device, w.dtype), b.to(w.device, w.dtype))

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
