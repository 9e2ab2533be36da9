"""The heap of a CPU training run: freed memory goes back to the system where it would otherwise
stay resident and make the process grow.

glibc's ``malloc`` keeps freed heap memory resident for reuse. Two places matter:

- **between constituents**: ``scpdr train`` fine-tunes them one after the other in one process;
  when one is done its model, gradients and optimizer state (2.2 GB for the 135M model) are
  freed, and :func:`trim_heap` hands the heap's free pages back (``malloc_trim(0)``, which since
  glibc 2.8 releases free pages anywhere in the heap, not only at its top), so the next
  constituent starts from what it needs;
- **inside a step**, where asked (``TrainConfig.trim_heap``; :func:`heap_trim_callback` and the
  chunked loss's ``trim_heap``): a step's freed activations and gradients leave free blocks
  scattered through the heap, which its next phase cannot all reuse (other sizes), so it maps
  new memory on top of them; the peak is reached in the phase that allocates the most new
  memory: the loss (the chunks' logits, tens of MB each, which glibc maps separately) and the
  optimizer step. Trimming at the step's start, after the model's forward (before the loss)
  and before the optimizer step returns those blocks first, at the price of faulting them in
  again. Measured on the 135M model (full fine-tuning, bf16, checkpointing, AMD Zen 4, 2
  threads), 8 of bench_train's skewed batches of 8 in fresh processes, 3 pairs: 5.60 -> 6.18 s
  per batch (+10%; 5-13% per pair) for a peak of 3.30 -> 2.99 GiB; bench_train, whose sides
  share one process and heap, gave +2% and +18% in two runs, peaks 3.41 -> 2.99 and 3.45 ->
  3.01 GiB at 8 x 256 tokens. 10% more time for 10% less memory: off by default, as the mmap
  threshold is not used either (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``: every tensor its own
  mapping; peak 2.8 GiB, 30% slower; 4 MiB: 2.96 GiB, 15% slower). Trimming only after the
  step changes neither the peak nor the time.

On CPU only (a GPU's memory is torch's caching allocator's); elsewhere than glibc (macOS, musl)
nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import platform
from typing import Any

__all__ = ["heap_trim_callback", "trim_heap"]


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
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trim_heap()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trim_heap()

    return HeapTrimCallback


def heap_trim_callback() -> Any:
    """A ``TrainerCallback`` returning the heap's free pages (:func:`trim_heap`) at each
    optimizer step's start and before its optimizer step (with the chunked loss's own trim after
    the forward: the three points of the module's measurement). For CPU training. (One class
    for every call: ``isinstance(cb, type(heap_trim_callback()))`` finds it.)"""
    return _callback_class()()
