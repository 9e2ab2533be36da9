"""KV caches whose decode steps do not copy the whole cache.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: every decode
step copies the layer's whole cache. A protected model decodes K + 1 models' rows at once (the
shared-base fast path stacks them into one batch; the general runner keeps one cache per model),
so this copy grows with (K + 1) x batch x context. On the embedded SmolLM2-135M's shapes at batch
8 (24 stacked rows, 30 layers), a step's appends and attention took 101 ms at 400 cached tokens
with ``torch.cat`` and 56 ms written in place, 191 against 112 ms at 800
(``benchmarks/bench_kv_cache.py``, docs/performance.md).

:func:`layer_class` is a ``DynamicLayer`` that keeps ``torch.cat`` for short caches and moves to
a buffer with room to spare once the cache holds :data:`BUFFER_FROM` tokens: a step then writes
its keys and values in place and hands attention views of the buffer's filled part; the buffer
is re-allocated (copied) only when full, with :data:`SPARE_FRACTION` of its length to spare, so
the copies cost O(1) per token. Short caches keep ``torch.cat``: attention reads the tensor
``torch.cat`` has just written from the cache, a buffer's rows from memory, and below ~100
tokens (batch 8) to ~200 (batch 1) that was the cheaper of the two (same benchmark); the
threshold sits past the batch-1 crossing.

Every other operation of a ``DynamicLayer`` (``crop``, ``batch_select_indices``, beam
reordering, a caller assigning ``keys``) replaces ``keys``/``values`` with new tensors; the next
update sees that they are no longer its buffer's views and copies them into a fresh buffer, so
the values attention sees are always those of ``DynamicLayer`` (tested bit for bit). Updates
write into the buffer in place: decoding runs them under ``torch.inference_mode`` (no autograd
graph holds a view), as ``scpdr.runtime.decoding`` does.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["BUFFER_FROM", "SPARE_FRACTION", "SPARE_MIN", "layer_class", "new_cache"]

#: Cached tokens from which a layer writes into a buffer instead of concatenating (measured:
#: docs/performance.md, ``benchmarks/bench_kv_cache.py``).
BUFFER_FROM = 256
#: Room a (re-)allocated buffer leaves: this fraction of the tokens it holds, at least
#: :data:`SPARE_MIN` tokens.
SPARE_FRACTION = 0.125
SPARE_MIN = 16


@functools.lru_cache(maxsize=1)
def layer_class() -> type:
    """The buffered ``DynamicLayer`` subclass (defined at first use: transformers is imported
    lazily)."""
    import torch
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys``/``values`` become views of a buffer with spare
        room once the layer holds :data:`BUFFER_FROM` tokens (see the module docstring)."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
            self._views: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values, views = self.keys, self.values, self._views
            held = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
            need = held + key_states.shape[-2]
            ours = views is not None and keys is views[0] and values is views[1]
            if not ours and need < BUFFER_FROM:  # short: plain concatenation
                if views is not None:
                    self._buffers = self._views = None
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if not ours or need > self._buffers[0].shape[-2]:  # (re-)allocate, copy what is held
                self._buffers = self._views = None  # the old buffer may go before the new one
                room = need + max(SPARE_MIN, int(need * SPARE_FRACTION))
                self._buffers = tuple(
                    s.new_empty(*s.shape[:-2], room, s.shape[-1])
                    for s in (key_states, value_states)
                )
                if held:
                    self._buffers[0][..., :held, :] = keys
                    self._buffers[1][..., :held, :] = values
            kb, vb = self._buffers
            kb[..., held:need, :] = key_states
            vb[..., held:need, :] = value_states
            self.keys, self.values = kb[..., :need, :], vb[..., :need, :]
            self._views = (self.keys, self.values)
            return self.keys, self.values

        def reset(self) -> None:
            self._buffers = self._views = None
            super().reset()

    return BufferedLayer


def new_cache() -> Any:
    """An empty ``DynamicCache`` whose layers are :func:`layer_class` ones."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = layer_class()
    return cache
