"""The model-runner protocol: how :class:`scpdr.runtime.ProtectedLM` gets logits, and the general
runner that runs one model after another.

A runner runs the G models a protected model needs (the K constituents, only constituent 0 for
"none", then the base model for the SCP methods' 'b' variant; paper §5.1) on one batch, with one
set of KV caches, and returns every model's float32 logits stacked: ``Tensor[G, ...]``. Two
runners exist: :class:`PerModelRunner` (one forward per model, any causal LMs) and
``scpdr.lora.StackedLoRA`` (LoRA adapters over one base: one stacked forward). Neither knows
about aggregation; the runtime picks one in :mod:`scpdr.runtime.loading`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scpdr.runtime.decode_step import LlamaDecodeStep, is_decoding_step, llama_decode_step

__all__ = [
    "ModelRunner",
    "PerModelRunner",
    "cache_kwargs",
    "index_positions",
    "llama_forward",
    "llama_head",
    "logits_buffer",
    "positions",
    "project",
    "run_split",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class ModelRunner(Protocol):
    """Runs G models on one batch with one cache and returns their float32 logits.

    Attributes:
        models: the G models in run order (constituents, then the base for 'b'), each usable as
            a causal LM on its own (the runtime reads their vocabulary size, device and
            generation config from them).
        names: a name per model, for messages.
        shared_base: whether one forward of a shared base serves every model (the LoRA fast
            path) rather than one forward per model.
    """

    models: Sequence[nn.Module]
    names: Sequence[str]
    shared_base: bool

    def new_caches(self) -> list[Any]:
        """Empty KV caches for one decoding batch: transformers ``Cache`` objects whose
        ``batch_select_indices(idx)`` keeps rows ``idx`` of the batch (``LongTensor[B']``)."""
        ...

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        caches: list[Any] | None = None,
        keep: int | Tensor = 0,
        out: Tensor | None = None,
    ) -> Tensor:
        """Logits of every model, float32.

        Args:
            input_ids, attention_mask, position_ids: ``(B, T)``.
            caches: from :meth:`new_caches` (grown in place), or None (no cache).
            keep: an int n keeps the last n positions (0 = all) → ``(G, B, T', V)``; a bool
                ``(B, T)`` tensor keeps those positions → ``(G, N, V)``; a long ``(B, 1)``
                tensor keeps one position per row → ``(G, B, 1, V)``.
            out: a float32 buffer the runner may write the logits into (its first elements)
                instead of allocating them: the result is then a view of it, overwritten when
                the buffer is passed again. A runner may ignore it; it does where the buffer is
                too small or on another device.
        """
        ...


def llama_forward(model: nn.Module) -> bool:
    """Whether ``model``'s forward is exactly ``LlamaForCausalLM.forward`` (its decoder
    ``model.model``, then ``model.lm_head`` at the kept positions; no hooks on the model or its
    head, none of accelerate's): a runner may then run the two steps itself."""
    from transformers.models.llama import modeling_llama as ml

    head = getattr(model, "lm_head", None)
    return (
        type(model) is ml.LlamaForCausalLM
        and type(getattr(model, "model", None)) is ml.LlamaModel
        and isinstance(head, nn.Module)
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not model._forward_hooks
        and not model._forward_pre_hooks
        and not hasattr(head, "_hf_hook")  # accelerate's offloading hooks
    )


def llama_head(model: nn.Module) -> nn.Linear | None:
    """``model``'s lm head when its forward is exactly ``LlamaForCausalLM.forward``
    (:func:`llama_forward`) and the head a bias-free ``nn.Linear``: then
    :class:`PerModelRunner` runs the decoder and the head itself, the head's matmul writing into
    the runner's output (:func:`project`); else None."""
    head = getattr(model, "lm_head", None)
    ok = llama_forward(model) and type(head) is nn.Linear and head.bias is None
    return head if ok else None


def project(head: nn.Linear, hidden: Tensor, out: Tensor) -> None:
    """``out`` (float32, ``(*lead, V)``) = ``head(hidden)``: a float32 head's matmul writes into
    ``out`` (the same floats as ``F.linear``: tested); another dtype's, or one under autograd, is
    converted or copied into it."""
    w = head.weight
    grad = torch.is_grad_enabled() and (w.requires_grad or hidden.requires_grad)
    if w.dtype == out.dtype == hidden.dtype and out.is_contiguous() and not grad:
        torch.mm(hidden.reshape(-1, hidden.shape[-1]), w.t(), out=out.view(-1, out.shape[-1]))
    else:
        out.copy_(F.linear(hidden, w))


def logits_buffer(shape: tuple[int, ...], device: torch.device, scratch: Tensor | None) -> Tensor:
    """A float32 tensor of ``shape`` on ``device``: a view of ``scratch``'s first elements where
    it is a float32 buffer there large enough (the runner protocol's ``out``), else new. A
    buffer reused over teacher-forced scoring's chunks is paged in once: at 8 x 128 tokens a
    fresh 225 MB of logits per chunk cost ~55 ms of page faults each (docs/performance.md)."""
    n = math.prod(shape)
    if (
        scratch is not None
        and scratch.dtype == torch.float32
        and scratch.device == device
        and scratch.is_contiguous()
        and scratch.numel() >= n
    ):
        return scratch.view(-1)[:n].view(shape)
    return torch.empty(shape, dtype=torch.float32, device=device)


def cache_kwargs(cache: Any | None) -> dict[str, Any]:
    """A forward's cache arguments: grow ``cache``, or run without one."""
    if cache is None:
        return {"use_cache": False}
    return {"past_key_values": cache, "use_cache": True}


def positions(mask: Tensor) -> Tensor:
    """Position ids from a 0/1 attention mask ``(B, T)``, as HF generate makes them."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def index_positions(logits: Tensor, keep: Tensor) -> Tensor:
    """``logits`` ``(*lead, B, T, V)`` at ``keep``: bool ``(B, T)`` → ``(*lead, N, V)``;
    long ``(B, 1)`` → ``(*lead, B, 1, V)``."""
    nb = logits.ndim - 3  # leading dims
    if keep.dtype == torch.bool:
        return logits[(slice(None),) * nb + (keep,)]
    rows = torch.arange(keep.shape[0], device=keep.device)
    return logits[(slice(None),) * nb + (rows, keep[:, 0])].unsqueeze(-2)


class PerModelRunner:
    """The general runner: one forward per model, each with its own ``DynamicCache``.

    The lm head runs only at the kept positions when a model accepts ``logits_to_keep``
    tensors; a model that does not (some architectures take ints only) is remembered and its
    full logits are indexed instead. Every model's logits land in one ``(G, ..., V)`` buffer:
    a Llama model's head writes into it directly (:func:`llama_head`), so the G models'
    logits are not stacked (teacher-forced scoring of 8 x 128 tokens, SCP-Δr-b: 3.5% of the
    score; docs/performance.md); other models' logits are copied in.
    """

    shared_base = False

    def __init__(
        self, models: Sequence[nn.Module], names: Sequence[str], *, vocab_size: int
    ) -> None:
        self.models = list(models)
        self.names = list(names)
        if len(self.names) != len(self.models):
            raise ValueError("one name per model")
        self.vocab_size = int(vocab_size)
        self._full_logits_only: set[int] = set()  # ids of models without logits_to_keep tensors
        #: Each model's lean one-token step (:mod:`scpdr.runtime.decode_step`; bitwise its
        #: forward), or None where the model keeps its forward; set an entry to None to turn
        #: it off.
        self.decode_steps: list[LlamaDecodeStep | None] = [
            llama_decode_step(m) for m in self.models
        ]
        #: Each model's lm head where the runner computes its logits from the decoder's hidden
        #: states straight into the one output buffer (:func:`llama_head`; bitwise its
        #: forward), or None where the model's forward runs and its logits are copied there;
        #: set an entry to None to turn it off.
        self.heads: list[nn.Linear | None] = [
            h if h is not None and h.out_features == self.vocab_size else None
            for h in map(llama_head, self.models)
        ]

    def new_caches(self) -> list[Any]:
        from scpdr.runtime.kv_cache import new_cache

        return [new_cache() for _ in self.models]

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        caches: list[Any] | None = None,
        keep: int | Tensor = 0,
        out: Tensor | None = None,
    ) -> Tensor:
        scratch, out = out, None  # out: (G, ..., V), every model's logits, written in place
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        for i in range(len(self.models)):
            cache = None if caches is None else caches[i]
            head = self.heads[i]
            lean = self.decode_steps[i] is not None and is_decoding_step(input_ids, keep, cache)
            if head is not None and not lean:
                hidden = self._hidden(i, inputs, keep, cache)
                if out is None:
                    shape = (len(self.models), *hidden.shape[:-1], head.out_features)
                    out = logits_buffer(shape, hidden.device, scratch)
                project(head, hidden, out[i])
                continue
            logits = self._logits(i, input_ids, attention_mask, position_ids, keep, cache)
            if out is None:
                out = logits_buffer((len(self.models), *logits.shape), logits.device, scratch)
            out[i] = logits
        assert out is not None
        return out

    @property
    def splits_heads(self) -> bool:
        """Whether the runner computes every model's head itself (:attr:`heads`): then
        :meth:`hidden_states` and :meth:`project_heads` give :meth:`__call__`'s logits in two
        steps, and teacher-forced scoring runs each decoder once over many rows while holding
        the logits of a few positions at a time (``scpdr.runtime.scoring``)."""
        return all(h is not None for h in self.heads)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: Tensor
    ) -> list[Tensor]:
        """Every model's last hidden states at the bool ``keep`` ``(B, T)`` positions (each
        ``(N, H)``, no cache), as its forward computes them before the head; with
        :attr:`splits_heads` only (ValueError otherwise)."""
        if not self.splits_heads:
            off = [n for n, h in zip(self.names, self.heads, strict=True) if h is None]
            raise ValueError(f"the runner does not run the heads of {off}: call it instead")
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return [self._hidden(i, inputs, keep, None) for i in range(len(self.models))]

    def project_heads(self, hidden: Sequence[Tensor], out: Tensor) -> Tensor:
        """``out`` ``(G, n, V)`` float32 = every model's head over its ``hidden[i]`` ``(n, H)``
        (from :meth:`hidden_states`, any slice of the positions): the logits :meth:`__call__`
        returns at those positions, bitwise for all of them (a slice's matmul over fewer rows
        may round differently). Returns ``out`` (a runner with these two methods returns the
        logits, in ``out`` where it can: ``scpdr.lora.StackedLoRA`` does not)."""
        if len(hidden) != len(self.models) or out.shape[0] != len(self.models):
            raise ValueError(
                f"one hidden-state tensor and one out row per model ({len(self.models)})"
            )
        for i, h in enumerate(hidden):
            head = self.heads[i]
            if head is None:
                raise ValueError(f"the runner does not run {self.names[i]}'s head")
            project(head, h, out[i])
        return out

    def _hidden(
        self, i: int, inputs: dict[str, Tensor], keep: int | Tensor, cache: Any | None
    ) -> Tensor:
        """Model ``i``'s last hidden states at the kept positions (``inputs``: the forward's
        ``input_ids``, ``attention_mask`` and ``position_ids``), as its forward computes
        them before its lm head (``LlamaForCausalLM.forward``: the decoder, then transformers'
        ``slice_logits_to_keep``)."""
        from transformers.modeling_utils import slice_logits_to_keep

        hidden = self.models[i].model(**inputs, **cache_kwargs(cache)).last_hidden_state
        return slice_logits_to_keep(hidden, keep)

    def _logits(
        self,
        i: int,
        input_ids: Tensor,
        mask: Tensor,
        position_ids: Tensor,
        keep: int | Tensor,
        cache: Any | None,
    ) -> Tensor:
        model, lean = self.models[i], self.decode_steps[i]
        if lean is not None and is_decoding_step(input_ids, keep, cache):
            return lean(input_ids, mask, position_ids, cache).float()
        kwargs = cache_kwargs(cache)

        def run(k: int | Tensor) -> Tensor:
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                logits_to_keep=k,
                **kwargs,
            )
            return out.logits.float()

        if isinstance(keep, int):
            return run(keep)
        if id(model) not in self._full_logits_only:
            if keep.dtype == torch.bool:
                expected: tuple[int, ...] = (int(keep.sum()), self.vocab_size)
            else:
                expected = (keep.shape[0], 1, self.vocab_size)
            try:
                logits = run(keep)
                if logits.shape == (1, *expected):
                    logits = logits[0]
                if tuple(logits.shape) == expected:
                    return logits
            except (TypeError, ValueError, IndexError, RuntimeError) as exc:
                logger.debug("logits_to_keep tensors unsupported (%s); indexing full logits", exc)
                if cache is not None:  # the failed call may have grown the cache: not retried
                    raise
            self._full_logits_only.add(id(model))
        return index_positions(run(0), keep)


def run_split(
    runner: ModelRunner,
    has_base: bool,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    caches: list[Any] | None = None,
    keep: int | Tensor = 0,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``runner``'s logits split into ``(constituents (K', ...), base | None)``: with
    ``has_base`` (variant 'b') the last model is the base. ``out``: the protocol's buffer."""
    if out is not None:
        out = runner(input_ids, attention_mask, position_ids, caches, keep, out=out)
    else:
        out = runner(input_ids, attention_mask, position_ids, caches, keep)
    return (out[:-1], out[-1]) if has_base else (out, None)
