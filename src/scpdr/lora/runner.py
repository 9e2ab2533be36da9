"""The shared-base runner (:mod:`scpdr.lora`; paper App. E): one base model and G groups (LoRA
adapters over it, or the base itself) run as one stacked batch of G·B rows (row ``g·B + b`` is
row b of group g), with one KV cache. It implements the runner protocol of
:mod:`scpdr.runtime.runner` and never imports ``ProtectedLM``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from scpdr.kernels.gemm import GemmLibrary, pack_panels
from scpdr.lora.adapters import LoraAdapter, UnsupportedAdapterError
from scpdr.lora.gemm_choice import StackKernel, choose_stack_kernel, choose_torch_rows
from scpdr.lora.layers import (
    GroupMode,
    PackedEmbedding,
    StackedLoraLinear,
    matching_source,
    packable,
    source_weight,
)
from scpdr.runtime.decode_step import LlamaDecodeStep, is_decoding_step, llama_decode_step

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

__all__ = ["LoraGroupView", "StackedLoRA", "new_stacked_cache"]


@functools.lru_cache(maxsize=1)
def _stacked_cache_class() -> type:
    from transformers import DynamicCache

    from scpdr.runtime.kv_cache import layer_class

    class StackedCache(DynamicCache):
        """A ``DynamicCache`` whose batch holds G groups of B rows (row ``g·B + b``):
        ``batch_select_indices(idx)``, with indices among the B rows, keeps them in every group.
        Its layers are :func:`scpdr.runtime.kv_cache.layer_class` ones (no whole-cache copy per
        step once long)."""

        def __init__(self, groups: int) -> None:
            super().__init__()
            self.layer_class_to_replicate = layer_class()
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


def to_bf16(model: nn.Module, source: Callable[[str], Tensor | None] | None = None) -> None:
    """``model.to(torch.bfloat16)`` with each float32 CPU weight rounded from ``source`` (module
    name -> its weight read from the checkpoint, :func:`scpdr.lora.checkpoint_weight_source`)
    where it holds the same tensor (shape; first, middle and last rows): the model's own weights
    are memory-mapped from the same file, and converting them would page in all of its float32
    bytes at once beside the bf16 copies (+0.5 GB resident for SmolLM2-135M), while a weight read
    from the checkpoint maps its file for that one tensor only. The result is the same bits."""
    for name, mod in model.named_modules():
        p = getattr(mod, "weight", None)
        if not isinstance(p, nn.Parameter) or p.device.type != "cpu":
            continue
        if p.dtype != torch.float32 or p.dim() != 2:  # converted already (a tied alias), or 1-D
            continue
        src = matching_source(source, name, p)
        if src is not None:
            p.data = src.to(torch.bfloat16)  # the float32 original is dropped, never paged in
    model.to(torch.bfloat16)  # the rest (norms, biases, float buffers), as before


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
            measured faster here (:func:`scpdr.lora.gemm_choice.choose_stack_kernel`); False (or
            ``SCPDR_GEMM_KERNEL=0``) keeps torch's matmuls (same results up to rounding).
        release_adapters: empty the adapters' ``LoraAdapter.modules`` once their matrices are
            copied into the stack, before the base weights are re-laid out (peak memory then
            holds one copy of the adapters instead of two). :func:`stacked_from_bundle` does, for
            the adapters it read.
        weight_dtype: ``torch.bfloat16`` keeps the base weights in bf16 (the model is then the
            bf16-rounded base's; the adapters stay float32): on the packed kernel, in bf16
            panels it widens exactly, computing in float32 (half the bytes streamed per
            decoding step); where the kernel is not used, the model is cast to bf16 and runs
            torch's bf16 matmuls (as a bf16-loaded model would). Default float32.
        q4_source: optional ``module name -> GGUF Q4_1 blocks | None`` of a base loaded from a
            GGUF file (:func:`scpdr.kernels.q4.gguf_q4_source`): with float32 weights on the
            packed kernel, where this machine runs the kernel faster on the blocks than on
            float32 panels and torch (:func:`scpdr.lora.gemm_choice.choose_q4`; also where
            the panels lose to torch: then only the linears with blocks run on the kernel),
            each linear whose blocks dequantize to its weight exactly streams them instead
            (the same results bit for bit).
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
        weight_dtype: torch.dtype = torch.float32,
        q4_source: Callable[[str], Tensor | None] | None = None,
    ) -> None:
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"weight_dtype must be torch.float32 or torch.bfloat16, not {weight_dtype}"
            )
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
        self.weight_dtype = weight_dtype
        self._wrap(groups, weight_source, use_kernel, q4_source)
        self.views = [LoraGroupView(self, i, n) for i, n in enumerate(self.names)]
        #: The lean one-token step (:mod:`scpdr.runtime.decode_step`; bitwise the model's forward)
        #: used for decoding steps, or None: the model's own forward for every call. Plain
        #: Llama models get one; setting it to None turns it off.
        self.decode_step: LlamaDecodeStep | None = llama_decode_step(model)

    def _wrap(
        self,
        groups: list[LoraAdapter | None],
        weight_source: Callable[[str], Tensor | None] | None,
        use_kernel: bool,
        q4_source: Callable[[str], Tensor | None] | None = None,
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
        bf16 = self.weight_dtype == torch.bfloat16
        stack = StackKernel()  # torch's matmuls, unless the packed kernel is measured faster
        q4: dict[str, Tensor] = {}  # the linears' GGUF Q4_1 blocks, each read once
        packs = [(name, layer, rank) for name, layer, rank in plans + others
                 if packable(layer.weight)]  # fmt: skip
        if use_kernel and packs:  # the packed kernel, where it is measured faster here
            if q4_source is not None and not bf16:
                for name, _, _ in packs:
                    blocks = q4_source(name)
                    if blocks is not None:
                        q4[name] = blocks
            shapes = [(layer.in_features, layer.out_features, rank) for _, layer, rank in packs]
            q4_shapes = [(layer.in_features, layer.out_features, rank)
                         for name, layer, rank in packs if name in q4]  # fmt: skip
            stack = choose_stack_kernel(
                shapes, q4_shapes, groups=self.num_groups, lora=self.num_lora
            )
        if not stack.q4:
            q4 = {}
        gemms = {name: stack.for_layer(name in q4) for name, _, _ in plans + others}
        if bf16 and stack.gemm is None:  # torch's bf16 matmuls, as a model loaded in bf16
            logger.info("bf16 weights without the packed kernel: the base runs in torch's bf16")
            to_bf16(self.model, weight_source)
        emb = self.model.get_input_embeddings()
        emb_weight = getattr(emb, "weight", None)
        emb_name = next((n for n, mod in named.items() if mod is emb), None)
        tied_head: StackedLoraLinear | None = None
        # Only now modify the model. The adapters' matrices first, then (release_adapters) the
        # adapters' own tensors go: they share one memory map per file, freed only with the last.
        matrices = {
            name: self._lora_matrices(groups, name, layer, rank, _width(gemms[name], layer))
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
        packed_layers: dict[str, list[StackedLoraLinear]] = {}  # by weight format
        for name in order:
            layer = self.model.get_submodule(name)
            gemm = gemms.pop(name)
            packed = _width(gemm, layer) is not None
            # a head tied to the input embeddings is read from the checkpoint under their name
            tied = emb_weight is not None and layer.weight is emb_weight
            source = source_weight(
                weight_source, emb_name if tied and emb_name else name, layer, packed=packed
            )
            a, b = matrices.pop(name, (None, None))
            wrapped = StackedLoraLinear(
                layer, a, b, self._mode, source=source, gemm=gemm, lora_packed=packed,
                weight_dtype=self.weight_dtype if packed else torch.float32, q4=q4.pop(name, None),
            )  # fmt: skip
            self.model.set_submodule(name, wrapped)
            if wrapped.weight_packed is not None:
                packed_layers.setdefault(wrapped.weight_format, []).append(wrapped)
            if tied and wrapped.weight_packed is not None and wrapped.weight_format != "q4_1":
                tied_head = wrapped
        for fmt, layers in packed_layers.items():  # many rows: torch's sgemm where faster
            assert stack.gemm is not None  # packed layers
            fmt_shapes = [(lin.in_features, lin.out_features, lin.rank) for lin in layers]
            many = choose_torch_rows(
                stack.gemm,
                fmt_shapes,
                groups=self.num_groups,
                lora=self.num_lora,
                weight_format=fmt,
            )
            for lin in layers:
                lin.torch_rows = many
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

    @property
    def splits_heads(self) -> bool:
        """Whether the base's forward is exactly Llama's (decoder, then head:
        ``scpdr.runtime.runner.llama_forward``): then :meth:`hidden_states` and
        :meth:`project_heads` give :meth:`__call__`'s logits in two steps (teacher-forced
        scoring runs the stacked decoder once over many rows and the head chunk by chunk, at the
        kept positions only)."""
        from scpdr.runtime.runner import llama_forward

        return llama_forward(self.model)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: Tensor
    ) -> list[Tensor]:
        """Every group's last hidden states at the bool ``keep`` ``(B, T)`` positions (each
        ``(N, H)``; one stacked decoder forward, no cache); with :attr:`splits_heads` only."""
        if not self.splits_heads:
            raise ValueError(f"{type(self.model).__name__} is not a plain Llama: call the runner")
        g, bsz = self.num_groups, input_ids.shape[0]
        ids, mask, pos = (t.repeat(g, 1) for t in (input_ids, attention_mask, position_ids))
        with self._stacked():
            hidden = self.model.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
            ).last_hidden_state  # (G·B, T, H)
        return list(hidden.view(g, bsz, *hidden.shape[1:])[:, keep])

    def project_heads(self, hidden: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
        """Every group's logits ``(G, n, V)`` float32 from its ``hidden[g]`` ``(n, H)`` (from
        :meth:`hidden_states`, any slice of the positions): the stacked head over the G groups'
        rows, as :meth:`__call__` runs it (up to the matmul's rounding over another row count).
        ``out`` is ignored (the stacked head makes one tensor already)."""
        if len(hidden) != self.num_groups:
            raise ValueError(f"one hidden-state tensor per group ({self.num_groups})")
        with self._stacked():
            logits = self.model.lm_head(torch.cat(list(hidden)))  # (G·n, V)
        return logits.float().view(self.num_groups, -1, logits.shape[-1])

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        caches: list[Any] | None = None,
        keep: int | Tensor = 0,
        out: Tensor | None = None,
    ) -> Tensor:
        """One forward of all groups (the runner protocol, ``scpdr.runtime.runner``):
        ``input_ids``/``attention_mask``/``position_ids`` ``(B, T)`` → float32 logits
        ``(G, B, T', V)`` (T' = ``keep`` or T when ``keep`` is an int), or the positions a
        ``keep`` tensor selects (``scpdr.runtime.runner.index_positions``). ``caches`` is one of
        :meth:`new_caches` (or None: no cache). ``out`` is ignored (the stacked forward's head
        makes the G groups' logits in one tensor already)."""
        from scpdr.runtime.runner import cache_kwargs, index_positions

        g, bsz = self.num_groups, input_ids.shape[0]
        cache = None if caches is None else caches[0]
        # (G·B, T), row g·B + b
        ids, mask, pos = (t.repeat(g, 1) for t in (input_ids, attention_mask, position_ids))
        lean = self.decode_step
        with self._stacked():
            if lean is not None and is_decoding_step(ids, keep, cache):
                logits = lean(ids, mask, pos, cache)  # (G·B, 1, V)
            else:
                logits = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    logits_to_keep=keep if isinstance(keep, int) else 0,
                    **cache_kwargs(cache),
                ).logits
        logits = logits.float()  # (G·B, T', V)
        logits = logits.view(g, bsz, *logits.shape[1:])
        return logits if isinstance(keep, int) else index_positions(logits, keep)
