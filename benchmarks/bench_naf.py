"""Cost of NAF aggregation relative to one decode step of the embedded SmolLM2-135M.

For every method of ``scpdr.naf.METHODS`` (and CP-Fuse's ``cp_fuse_step``) and batch sizes
B in {1, 8, 64}: the median time of aggregating K = 2 constituents (+ a base for the SCP
methods) at V = 49152, divided by the median time of one KV-cached decode step (batch B, one new
token after a 16-token prompt) of the real model, measured round-robin in the same run. Before
each aggregation an untimed decode step runs and the logits are rewritten (untimed), as in real
decoding, where the aggregation follows the model's step and its head has just written the
logits: the aggregation sees the caches a decode step leaves, not ones warmed by the method
timed before it.

By default both are this thread's CPU time with one torch thread (``--clock cpu``): on a shared
machine, wall time with two OpenMP threads swings by 10x with other processes' load (measured:
a B = 1 decode step took 73 ms on a quiet machine and 760 ms at load 11 on 2 cores).
``--clock wall --threads N`` measures wall time instead.

The C kernels (SCP-Δr, CP-Fuse's statistics) are built for each ``--targets`` ISA (default: the
native one and ``x86-64-v3``, the AVX2 + FMA code most x86 users run, which an AVX-512 machine
runs too) and timed in the same rounds: ``ratios`` are the native build's (what
``naf.aggregate`` uses here, after its kernel/torch choice), and ``isa`` holds every build's
ratios for the kernel methods, its instruction set and its kernel/torch decisions.

Goals: scp-delta-r <= 0.01 at B = 1 and <= 0.02 at B = 8; cp-fuse <= 0.10 at B = 8.

    python benchmarks/bench_naf.py [--quick] [--clock cpu|wall] [--threads N] [--targets ...]

Last stdout line: ``{"bench": "naf", "ratios": {"<method>@B<b>": ...}, "ms": {...}, "isa":
{"native": {"isa": "avx512", "ratios": {...}, "decisions": {...}}, "x86-64-v3": {...}}, ...}``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    cpu_model,
    decode_step_fn,
    default_targets,
    emit,
    interleaved_medians,
    load_embedded_model,
    setup,
)

logger = logging.getLogger("scpdr.benchmarks.naf")

VOCAB = 49152
BATCH_SIZES = (1, 8, 64)
GOALS = {"scp-delta-r@B1": 0.01, "scp-delta-r@B8": 0.02, "cp-fuse@B8": 0.10}
#: Methods with a C kernel, timed for every build target.
KERNEL_METHODS = ("scp-delta-r", "cp-fuse")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under 5 minutes)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    ap.add_argument("--no-cp-fuse", action="store_true", help="skip cp_fuse_step")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): this thread's CPU time with one torch thread, which other "
        "processes on a shared machine barely inflate; wall: wall time with --threads threads",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads for --clock wall")
    ap.add_argument(
        "--targets",
        nargs="+",
        default=None,
        help="kernel build targets (-march values) to time besides native (default on x86: "
        "x86-64-v3 when this CPU has AVX2)",
    )
    args = ap.parse_args(argv)
    threads = setup(threads=1 if args.clock == "cpu" else args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    import torch

    from scpdr import kernels, naf

    targets = ["native", *(args.targets if args.targets is not None else default_targets())]

    repeats = {1: 15, 8: 9, 64: 5} if args.quick else {1: 60, 8: 30, 64: 12}
    loaded = load_embedded_model()
    model = loaded[0] if loaded else None
    vocab = model.config.vocab_size if model is not None else VOCAB

    ms: dict[str, float] = {}
    ratios: dict[str, float | None] = {}
    gen = torch.Generator().manual_seed(0)
    for b in args.batch_sizes:
        # Logits of a realistic scale: a shared component plus per-model noise.
        shared = torch.randn(b, vocab, generator=gen) * 3
        src_logps = shared + torch.randn(2, b, vocab, generator=gen)
        src_base = shared + torch.randn(b, vocab, generator=gen)
        logps, base = src_logps.clone(), src_base.clone()

        step = decode_step_fn(model, batch=b) if model is not None else None

        def fresh_logits(
            logps=logps, base=base, src_logps=src_logps, src_base=src_base, step=step
        ) -> None:
            # In decoding, every aggregation follows a decode step (which streams the weights
            # through the caches), and the models' heads write the logits right before it: an
            # untimed decode step, then an untimed copy of the logits. Without the step, each
            # method would find the scratch buffers warm from the method timed before it.
            if step is not None:
                step()
            logps.copy_(src_logps)
            base.copy_(src_base)

        fns: dict = {}
        if step is not None:
            fns["decode"] = step
        for method in naf.METHODS:
            fns[method] = (fresh_logits, partial(naf.aggregate, method, logps, base=base, m=10))
        for target in targets[1:]:  # the other builds of the kernel methods, same rounds
            fns[f"scp-delta-r[{target}]"] = (
                fresh_logits,
                partial(with_target, target, naf.aggregate, "scp-delta-r", logps, base=base, m=10),
            )
        for target in [] if args.no_cp_fuse else targets:
            name = "cp-fuse" if target == "native" else f"cp-fuse[{target}]"
            path = torch.zeros(2, b)
            fns[name] = (fresh_logits, partial(with_target, target, naf.cp_fuse_step, logps, path))
        with torch.inference_mode():
            med = interleaved_medians(fns, repeats=repeats.get(b, 5), clock=args.clock)
        for name, sec in med.items():
            ms[f"{name}@B{b}"] = round(sec * 1e3, 4)
        for name, sec in med.items():
            if name == "decode":
                continue
            key = f"{name}@B{b}"
            ratios[key] = round(sec / med["decode"], 5) if "decode" in med else None
            logger.info("B=%-3d %-12s %9.3f ms  ratio %s", b, name, sec * 1e3, ratios[key])
        if "decode" in med:
            logger.info("B=%-3d %-12s %9.3f ms", b, "decode", med["decode"] * 1e3)
    goals_met = {
        k: (ratios.get(k) is not None and ratios[k] <= v) for k, v in GOALS.items() if k in ratios
    }
    isa = per_target(targets, ratios, kernels)
    emit(
        "naf",
        {k: v for k, v in ratios.items() if "[" not in k},
        ms=ms,
        goals=GOALS,
        goals_met=goals_met,
        isa=isa,
        vocab=vocab,
        threads=threads,
        clock=args.clock,
        load_average=load,
        cpu=cpu_model(),
        quick=args.quick,
        model="SmolLM2-135M-Instruct" if model is not None else None,
    )
    return 0


def with_target(target: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the kernels of build ``target``."""
    from scpdr import kernels

    with kernels.using_target(target):
        return fn(*args, **kwargs)


def per_target(targets: list[str], ratios: dict, kernels) -> dict:
    """``{target: {"isa", "ratios" of the kernel methods, "goals_met", "decisions"}}``."""
    decisions = kernels.decisions()
    out = {}
    for t in targets:
        lib = kernels.scp.library(target=t)
        suffix = "" if t == "native" else f"[{t}]"
        rs = {
            f"{m}@B{b}": ratios[f"{m}{suffix}@B{b}"]
            for m in KERNEL_METHODS
            for b in BATCH_SIZES
            if f"{m}{suffix}@B{b}" in ratios
        }
        out[t] = {
            "isa": None if lib is None else lib.isa,
            "ratios": rs,
            "goals_met": {k: rs[k] is not None and rs[k] <= v for k, v in GOALS.items() if k in rs},
            "decisions": {k: v for k, v in decisions.items() if f", {t} build)" in k},
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
