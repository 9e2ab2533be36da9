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
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from scpdr.runtime.decode_step import LlamaDecodeStep, is_decoding_step, llama_decode_step

__all__ = ["ModelRunner", "PerModelRunner", "index_positions", "positions", "run_split"]

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
    ) -> Tensor:
        """Logits of every model, float32.

        Args:
            input_ids, attention_mask, position_ids: ``(B, T)``.
            caches: from :meth:`new_caches` (grown in place), or None (no cache).
            keep: an int n keeps the last n positions (0 = all) → ``(G, B, T', V)``; a bool
                ``(B, T)`` tensor keeps those positions → ``(G, N, V)``; a long ``(B, 1)``
                tensor keeps one position per row → ``(G, B, 1, V)``.
        """
        ...


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
    full logits are indexed instead.
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
    ) -> Tensor:
        return torch.stack(
            [
                self._logits(
                    i,
                    input_ids,
                    attention_mask,
                    position_ids,
                    keep,
                    None if caches is None else caches[i],
                )
                for i, model in enumerate(self.models)
            ]
        )

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
        kwargs: dict[str, Any] = (
            {"past_key_values": cache, "use_cache": True}
            if cache is not None
            else {"use_cache": False}
        )

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
) -> tuple[Tensor, Tensor | None]:
    """``runner``'s logits split into ``(constituents (K', ...), base | None)``: with
    ``has_base`` (variant 'b') the last model is the base."""
    out = runner(input_ids, attention_mask, position_ids, caches, keep)
    return (out[:-1], out[-1]) if has_base else (out, None)
