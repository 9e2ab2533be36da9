"""The memory of a CPU training run: freed heap memory goes back to the system where it would
otherwise stay resident and make the process grow, and autocast keeps no second copy of the
weights.

glibc's ``malloc`` keeps freed heap memory resident for reuse. Two places matter:

- **between constituents**: ``scpdr train`` fine-tunes them one after the other in one process;
  when one is done its model, gradients and optimizer state (2.2 GB for the 135M model) are
  freed, and :func:`trim_heap` hands the heap's free pages back (``malloc_trim(0)``, which since
  glibc 2.8 releases free pages anywhere in the heap, not only at its top), so the next
  constituent starts from what it needs;
- **inside a step** (``TrainConfig.trim_heap``, on by default on CPU;
  :func:`heap_trim_callback` and the chunked loss's ``trim_heap``): a step's freed activations
  and gradients leave free blocks scattered through the heap, which its next phase cannot all
  reuse (other sizes), so it maps new memory on top of them. glibc's mmap threshold rises to
  the largest block freed (up to 32 MiB), so after the first step every tensor of a layer's
  size lives on the heap: on the 135M model (full fine-tuning, bf16, checkpointing, AMD Zen 4,
  2 threads, 8 x 256 tokens) the tensors alive at the peak were 1.8 GiB of ``malloc``'s and
  another 1.0 GiB of freed heap stayed resident beside them. Trimming after the model's
  forward (before the loss, whose chunks are the step's largest new blocks) and before the
  optimizer step returns those blocks first, at the price of faulting them in again: peak RSS
  3.25 -> 2.84 GiB for about 5% more time per step (4 steps in fresh processes; bench_train
  reports both, ``heap_trim_cost``). A third trim at the step's start lowered the peak no
  further. The mmap threshold itself is left alone (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``: every
  tensor its own mapping; peak 2.8 GiB, 30% slower; 4 MiB: 2.96 GiB, 15% slower), and so is
  ``THP_MEM_ALLOC_ENABLE`` (torch's huge pages for tensors >= 2 MiB: peak 3.14 GiB, slower).

Trimming is for CPU only (a GPU's memory is torch's caching allocator's); elsewhere than glibc
(macOS, musl) nothing is done.

bf16 autocast in training keeps no cache of its weight casts (:data:`AUTOCAST_CACHE`): each
weight is cast once per forward anyway, and under activation checkpointing nothing else keeps
those copies, so the cache only held the model's bf16 copy through the forward (0.2 GiB of the
135M model's forward peak). The Trainer's autocast is set so (:mod:`scpdr.training.trainer`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import platform
from typing import Any

__all__ = ["AUTOCAST_CACHE", "heap_trim_callback", "trim_heap"]

#: Whether training's bf16 autocast caches its casts of the weights (``torch.autocast``'s
#: ``cache_enabled``): no, see the module's docstring.
AUTOCAST_CACHE = False


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None elsewhere."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - glibc has had it since 2.0
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap(*, collect: bool = False) -> bool:
    """Return the heap's free pages to the system (after a garbage collection if ``collect``);
    whether anything was returned (False: nothing to return, or not glibc)."""
    if collect:
        gc.collect()
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


@functools.lru_cache(maxsize=1)
def _callback_class() -> type:
    from transformers import TrainerCallback

    class HeapTrimCallback(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trim_heap()

    return HeapTrimCallback


def heap_trim_callback() -> Any:
    """A ``TrainerCallback`` returning the heap's free pages (:func:`trim_heap`) before each
    optimizer step (with the chunked loss's own trim after the forward: the two points of the
    module's measurement). For CPU training. (One class for every call:
    ``isinstance(cb, type(heap_trim_callback()))`` finds it.)"""
    return _callback_class()()
