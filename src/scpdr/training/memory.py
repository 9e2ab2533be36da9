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
  further. **In the backward pass** (:func:`trim_at_layers`, installed by the callback):
  each layer's gradients are new blocks while the activations it recomputed are freed around
  them, so RSS climbed through the backward (float32, Intel Xeon without bf16 units, 2
  threads, 8 x 256 tokens: 2.38 -> 3.18 GiB over the 30 layers, ~1 GiB of free heap beside)
  and the step's peak was at its end. Trimming after the backward of every 10th decoder layer
  (:data:`TRIM_EVERY_LAYERS`) gave that step 3.35-3.39 -> 2.89-2.90 GiB (every 5th layer:
  2.79-2.80), and bench_train's ``heap_trim_cost`` read 1.03 with it. Each trim inside a step
  runs only where the heap holds at least :data:`STEP_TRIM_MIN_FREE` (0.5 GiB) free
  (:func:`heap_free_bytes`): small steps free less (~0.4 GiB after the forward on 20 of the
  demo's short records, 0.7-0.8 GiB on 8 x ~250 tokens), and trimming them at every step
  cost 13-18% of their time for 0.09 GiB of peak; with the threshold they run as fast as
  untrimmed, and the 8 x 256 step keeps 2.92 GiB. The backward's last trim, after layer 0's
  backward, runs whatever the heap holds where the input embeddings are trained: the step's
  peak was then at the backward's end, where the input embedding's gradient (a fresh V x H
  block: 108 MiB on the 135M model) lands on top of every other gradient and ~0.4 GiB of free
  heap (bf16, fused AdamW, Intel Xeon AVX-512, 2 threads, 8 x 256 tokens, three fresh
  processes each: 2.87-2.98 -> 2.76-2.79 GiB). One unconditional trim there cost nothing
  measurable (second step 5.2-5.9 s against 5.5-6.2 s; 8 x 32 tokens: 1.23-1.36 s against
  1.31-1.40 s per step). Where the input embeddings are frozen (LoRA) no such gradient comes
  last, and that trim keeps the threshold. **In the forward pass** the same layers' hooks trim
  too, just before layers 10 and 20 run (with the threshold): a step starts with the last
  step's freed gradients (0.4-0.6 GiB) resident in the heap, and in some processes the
  forward's blocks went beside them rather than into them: RSS at the forward's end read
  2.51-2.81 GiB, and 4 fresh processes of 17 peaked at 2.87-2.98 GiB (where traced, at the
  loss's start; the others at 2.78-2.84; the 8 x 256 step above). With the forward's trims
  the forward ended at 2.22-2.32 GiB and the peak read 2.76-2.82 GiB in 17 fresh processes,
  at the same time per step.
  ``fordblks`` counts free blocks whether their pages are resident or not, and a trim leaves
  the blocks in place: once a large step has left 0.5 GiB of free blocks, the small steps after
  it are trimmed again (as every step was before the threshold). The mmap threshold itself is
  left alone (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``: every tensor its own mapping; peak
  2.8 GiB, 30% slower; 4 MiB: 2.96 GiB, 15% slower), and so is
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
from collections.abc import Callable
from typing import Any

__all__ = [
    "AUTOCAST_CACHE",
    "STEP_TRIM_MIN_FREE",
    "TRIM_EVERY_LAYERS",
    "heap_free_bytes",
    "heap_trim_callback",
    "trim_at_layers",
    "trim_heap",
    "trim_step_heap",
]

#: Whether training's bf16 autocast caches its casts of the weights (``torch.autocast``'s
#: ``cache_enabled``): no, see the module's docstring.
AUTOCAST_CACHE = False
#: A trim inside a step is skipped when the heap holds less free memory than this (glibc's
#: ``mallinfo2().fordblks``; see the module's docstring): 0.5 GiB.
STEP_TRIM_MIN_FREE = 1 << 29
#: The heap is trimmed at every this-many-th decoder layer, before its forward and after its
#: backward (:func:`trim_at_layers`; see the module's docstring).
TRIM_EVERY_LAYERS = 10


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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (2.33 and later), or None."""
    if _malloc_trim() is None:
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # an older glibc
        return None
    fn.argtypes, fn.restype = [], _MallInfo2
    return fn


def heap_free_bytes() -> int | None:
    """Bytes of free memory ``malloc``'s heaps hold (``mallinfo2().fordblks``: freed blocks
    kept for reuse, resident or not), or None where glibc does not report it."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def trim_step_heap() -> bool:
    """:func:`trim_heap` inside a training step: only where the heap holds at least
    :data:`STEP_TRIM_MIN_FREE` free (read at each call)."""
    return trim_heap(min_free=STEP_TRIM_MIN_FREE)


def trim_heap(*, collect: bool = False, min_free: int = 0) -> bool:
    """Return the heap's free pages to the system (after a garbage collection if ``collect``);
    whether anything was returned (False: nothing to return, not glibc, or less than
    ``min_free`` bytes free in the heap, where it is known: the trim is then skipped)."""
    if collect:
        gc.collect()
    fn = _malloc_trim()
    if fn is None:
        return False
    if min_free > 0:
        free = heap_free_bytes()
        if free is not None and free < min_free:
            return False
    return bool(fn(0))


def trim_at_layers(model: Any, every: int = TRIM_EVERY_LAYERS) -> list[Any]:
    """Trim the heap at every ``every``-th decoder layer (transformers'
    ``GradientCheckpointingLayer`` instances, layers 0, every, 2·every...) in both passes of a
    training step: in the forward just before such a layer runs (not layer 0, at the step's
    start), and in the backward each time the gradient of such a layer's input is complete,
    i.e. just after that layer's backward. Each trim runs where the heap holds
    :data:`STEP_TRIM_MIN_FREE` free (:func:`trim_step_heap`), except the backward's last, after
    layer 0's backward (before the input embedding's gradient and the optimizer step), which
    runs always where that gradient comes (the input embeddings are trained, as in full
    fine-tuning: :func:`trim_heap`; see the module's docstring). Returns the hooks' handles
    (``.remove()`` each to undo).

    A forward pre-hook on each such layer does the forward's trim and puts a gradient hook on
    the layer's input, when that input is part of the graph (``grad_fn`` set: not a forward
    without gradients, nor the detached copy an activation-checkpoint recompute runs on, so
    each trim happens once per pass)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def trim(_grad: Any) -> None:
        trim_step_heap()

    def trim_last(_grad: Any) -> None:
        trim_heap()

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    trained = bool(getattr(getattr(embeddings, "weight", None), "requires_grad", False))

    def pre_hook(index: int) -> Callable[[Any, tuple], None]:
        def hook(_module: Any, args: tuple) -> None:
            x = args[0] if args else None
            if getattr(x, "grad_fn", None) is not None:
                if index > 0:
                    trim_step_heap()
                x.register_hook(trim_last if index == 0 and trained else trim)

        return hook

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [
        layer.register_forward_pre_hook(pre_hook(i))
        for i, layer in enumerate(layers)
        if i % every == 0
    ]


@functools.lru_cache(maxsize=1)
def _callback_class() -> type:
    from transformers import TrainerCallback

    class HeapTrimCallback(TrainerCallback):
        def __init__(self) -> None:
            self.handles: list[Any] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if kw.get("model") is not None and not self.handles:
                self.handles = trim_at_layers(kw["model"])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            for h in self.handles:
                h.remove()
            self.handles = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trim_step_heap()

    return HeapTrimCallback


def heap_trim_callback() -> Any:
    """A ``TrainerCallback`` returning the heap's free pages (:func:`trim_heap`) in the
    forward and backward passes (:func:`trim_at_layers`, installed at the start of training)
    and before each optimizer step, where the heap holds at least :data:`STEP_TRIM_MIN_FREE`
    free (with the chunked loss's own trim after the forward: the points of the module's
    measurement). For CPU training. (One class for every call:
    ``isinstance(cb, type(heap_trim_callback()))`` finds it.)"""
    return _callback_class()()
