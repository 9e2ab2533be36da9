"""KV cache appends of a protected decode step: scpdr's buffered layer vs transformers'
``DynamicLayer``.

A protected model decodes K + 1 models' rows at once (SCP-Δr-b over two constituents: the base
and two adapters, 3·B stacked rows on the LoRA fast path). Per decode step, each of the
embedded SmolLM2-135M's 30 layers appends one token's keys and values to its cache and runs
attention over the whole cache (``F.scaled_dot_product_attention``, 9 query heads on 3 KV heads
of 64, as the model's SDPA attention calls it). ``DynamicLayer`` appends with ``torch.cat``:
each step copies the whole cache. ``scpdr.runtime.kv_cache.layer_class()`` concatenates below
``BUFFER_FROM`` cached tokens and writes into a buffer with spare room from there on.

For each batch size B and cache length T: the time of ``--steps`` consecutive decode steps
(append + attention in all 30 layers) from a cache of T tokens, per step, for both layers
(interleaved rounds; a fresh cache of T tokens is built untimed before each timed run).
``ratios`` are DynamicLayer's time / the buffered layer's (> 1: the buffer is faster) at the
lengths where the buffered layer writes in place (T >= BUFFER_FROM); ``below`` holds the
shorter lengths, where both run ``torch.cat`` (ratios ~1 by construction; reported to show the
threshold costs nothing).

Goal: ratios >= 1.0 at every T >= BUFFER_FROM (a fast path is never slower than the plain one).

This thread's CPU time with one torch thread by default (``--clock cpu``).

    python benchmarks/bench_kv_cache.py [--quick] [--lengths T ...] [--batch-sizes B ...]

Last stdout line: ``{"bench": "kv_cache", "ratios": {"B8@T400": ..., ...}, "goals_met":
{...}, "ms_per_step": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, emit, interleaved_medians, setup

logger = logging.getLogger("scpdr.benchmarks.kv_cache")

#: SmolLM2-135M: decoder layers, KV heads, query heads, head size.
LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64
GROUPS = 3  # SCP-Δr-b over K = 2: two constituents and the base, stacked


def step_runner(layer_cls, rows: int, length: int, steps: int):
    """``(prepare, run)``: prepare builds a cache of ``length`` tokens per layer (untimed);
    run decodes ``steps`` steps (append + attention in every layer)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    shape = (rows, KV_HEADS, 1, HEAD_DIM)
    new = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))] * steps
    q = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=gen)
    prefix = torch.randn(rows, KV_HEADS, length, HEAD_DIM, generator=gen)
    state: dict = {}

    def prepare() -> None:
        state["layers"] = []
        for _ in range(LAYERS):
            layer = layer_cls()
            layer.update(prefix.clone(), prefix.clone())
            state["layers"].append(layer)

    def run() -> None:
        with torch.inference_mode():
            for k, v in new:
                for layer in state["layers"]:
                    keys, values = layer.update(k, v)
                    F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    return prepare, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (about a minute)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 400, 800])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for --clock wall")
    args = ap.parse_args(argv)
    threads = setup(threads=1 if args.clock == "cpu" else args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    from transformers.cache_utils import DynamicLayer

    from scpdr.runtime import kv_cache

    repeats = args.repeats or (5 if args.quick else 15)
    ratios: dict[str, float | None] = {}
    below: dict[str, float] = {}
    ms: dict[str, float] = {}
    for b in args.batch_sizes:
        for t in args.lengths:
            rows = GROUPS * b
            fns = {
                "dynamic": step_runner(DynamicLayer, rows, t, args.steps),
                "buffered": step_runner(kv_cache.layer_class(), rows, t, args.steps),
            }
            med = interleaved_medians(fns, repeats=repeats, warmup=1, clock=args.clock)
            key = f"B{b}@T{t}"
            for name, sec in med.items():
                ms[f"{name}@{key}"] = round(sec / args.steps * 1e3, 3)
            ratio = round(med["dynamic"] / med["buffered"], 3)
            (ratios if t >= kv_cache.BUFFER_FROM else below)[key] = ratio
            logger.info(
                "%s (%d rows): DynamicLayer %.2f ms/step, buffered %.2f ms/step: %.2fx",
                key, rows, ms[f"dynamic@{key}"], ms[f"buffered@{key}"], ratio,
            )  # fmt: skip
    goals_met = {k: v is not None and v >= 1.0 for k, v in ratios.items()}
    emit(
        "kv_cache",
        ratios,
        goals={k: 1.0 for k in ratios},
        goals_met=goals_met,
        below=below,
        buffer_from=kv_cache.BUFFER_FROM,
        ms_per_step=ms,
        steps=args.steps,
        repeats=repeats,
        threads=threads,
        clock=args.clock,
        cpu=cpu_model(),
        load_average=load,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
