"""SCP-Δr-b over LoRA constituents (shared-base fast path) vs a single model.

On the embedded SmolLM2-135M, two random rank-64 LoRA adapters (α 32, paper App. E) on every
projection module (q, k, v, o, gate, up, down; non-zero B so the deltas matter) are bundled
with the base; ``ProtectedLM.from_bundle`` detects them and runs base + 2 adapters as one
stacked batch. The base is the embedded GGUF's, so each build's stack streams its projections'
Q4_1 blocks where that build measured them paying against float32 panels (``choose_q4``: their
speedups at batch 1 and 8 multiply to more than 1, no slower than torch; the same results bit
for bit, docs/lora_fast_path.md): its ``q4-...`` entry in ``isa.<build>.decisions``
says which it runs. Measured round-robin in one run (the CPU is shared):

- greedy decode tokens/s of SCP-Δr-b (``ProtectedLM.generate``, no early stop) divided by HF
  ``generate`` tokens/s of one unprotected model, same prompts, B in {1, 8}. A decode step's
  time is ``(t(n tokens) - t(1 token)) / (n - 1)`` (prefill excluded; end-to-end ratios are
  reported too); the general path (three separate models) is timed alongside for reference;
- the ceiling of any shared-base path (``stacked_rows_ceiling``): the same single model's step
  time at B rows divided by its step time at 3·B rows (base + 2 constituents stacked, with no
  adapter deltas and no aggregation) — what stacking alone costs on this machine with torch's
  matmuls;
- ``same_kernel_ratios``: the fast path against one model decoding through the *same* packed C
  kernels (the stack's base group, a plain greedy loop): what the shared-base batching costs
  once both sides use the faster matmuls (the main ratios compare with the unprotected model as
  users run it, HF ``generate`` with torch's matmuls);
- ``bf16_weights``: the same fast path with the base's weights kept in bf16 on the packed
  kernel (``ProtectedLM.from_bundle(dtype=torch.bfloat16)``, ``scpdr serve --precision bf16``;
  the served model is then the bf16-rounded one): its ratio to HF generate, and ``speedup``:
  the float32-weight fast path's step time over its own, per build and batch size
  (``--no-bf16`` skips it); the goals' row wherever ``auto`` serves bf16 weights (below);
- ``served_default``: per build, the precision ``scpdr serve`` decodes with by default
  (``--precision auto``: bf16 base weights only where the CPU has bf16 units and a
  micro-benchmark finds them faster at batch 1 and 8, ``scpdr.serve.precision``), its reason,
  that precision's ratios (speed and memory) and whether they meet the goals;
- peak resident memory (``ru_maxrss``) of a process that loads the fast-path protected model and
  decodes, divided by that of a process that loads one model and decodes (fresh subprocesses),
  for the float32 weights and, where ``auto`` serves them, the bf16 ones.

**What the goals judge**: the protected model as ``scpdr serve`` runs it by default against the
unprotected model as users run it (HF ``generate``, float32 on CPU). ``ratios`` and
``goals_met`` are the native build's served default; ``float32_ratios`` always hold the
float32-weight row. Where ``auto`` keeps float32 (e.g. AMD Zen 4, where bf16 weights are no
faster) the two are the same numbers; where it serves bf16 weights (a CPU whose bf16 units make
them faster) the float32 row stays reported beside it.

The packed GEMM and the SCP-Δr kernel are built for each ``--targets`` ISA (default: the native
one and ``x86-64-v3``, the AVX2 + FMA code most x86 users run) and a fast-path model per build
is timed in the same rounds against the same HF baseline: ``ratios`` are the native build's,
``isa`` holds each build's ratios (served default and float32; speed, same-kernel, memory),
instruction set and kernel/torch decisions (each build's kernels are used only where measured
faster than torch).

Times are this thread's CPU time by default (``--clock cpu`` with one torch thread, where all
the work runs on it): on a shared 2-core machine wall-clock ratios swung from 0.72 to 1.0 between
two quick runs at load 4-5, CPU-time ones do not. ``--threads N --clock wall`` measures wall time.

Goals: speed ratios >= 0.75, memory ratio <= 1.25 (every ISA; where one cannot
reach them, its path must still be no slower than torch's).

    python benchmarks/bench_lora.py [--quick] [--threads N] [--only speed|memory] [--targets ...]

Last stdout line: ``{"bench": "lora", "ratios": {"scp-delta-r-b@B1": ..., "scp-delta-r-b@B8":
..., "memory": ...}, "precision": "fp32"|"bf16", "float32_ratios": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, default_targets, emit, interleaved_medians, setup
from _lora_report import (
    BF16,
    GOALS,
    bf16_key,
    decode_choices,
    memory_key,
    per_target,
    served_default,
    target_key,
)

logger = logging.getLogger("scpdr.benchmarks.lora")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, and when you would use one instead of a list.",
    "What are three good habits for keeping a small vegetable garden healthy?",
    "Summarize the main causes of the French Revolution in a few sentences please.",
    "Describe the water cycle to a ten year old child in simple, friendly words.",
    "Give me a recipe for a quick vegetarian dinner that uses chickpeas and rice.",
    "Why is the sky blue during the day but red and orange during the sunset?",
    "List some tips for writing clear and maintainable Python code for a team.",
]
CHILD_TOKENS = 16


def build_bundle(root: Path, base, *, rank: int, alpha: float, k: int = 2) -> Path:
    """``root/adapter-<i>`` (random LoRA over the embedded base) and a bundle in ``root``."""
    from scpdr import models
    from scpdr.lora import save_random_lora

    base_dir = models.base_model_dir()
    refs = [
        save_random_lora(
            base,
            root / f"adapter-{i}",
            base_ref=str(base_dir),
            r=rank,
            alpha=alpha,
            target_modules=TARGETS,
            seed=i,
            std=0.02,
        )
        for i in range(k)
    ]
    return models.write_bundle(root / "bundle", base=base_dir, constituents=refs)


def greedy_decode(model, enc, n: int) -> None:
    """``n`` greedy tokens from ``model`` (a causal LM forward, e.g. a stack's group view) with a
    KV cache: the leanest decode loop (no logits processors), for the same-kernel baseline."""
    import torch
    from transformers import DynamicCache

    ids, mask = enc["input_ids"], enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    with torch.inference_mode():
        for _ in range(n):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], 1)
            pos = pos[:, -1:] + 1


def child(kind: str, bundle: str, n_new: int, *, bf16: bool = False) -> int:
    """Load one model (``single``) or the fast-path protected bundle (``protected``, kernels of
    ``$SCPDR_KERNEL_TARGET``; base weights in bf16 with ``bf16``), decode ``n_new`` greedy
    tokens for one prompt, print ``{"maxrss_kb": ...}``."""
    import resource

    import torch

    from scpdr import models
    from scpdr.runtime import ProtectedLM

    if kind == "single":
        model, tok = models.load_base()
        enc = tok(PROMPTS[:1], return_tensors="pt")
        with torch.inference_mode():
            model.generate(
                **enc,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
    else:
        dtype = torch.bfloat16 if bf16 else None
        lm = ProtectedLM.from_bundle(bundle, dtype=dtype, device="cpu")
        if not lm.fast_path.on:
            raise RuntimeError(f"the LoRA fast path did not engage ({lm.fast_path.reason})")
        lm.generate(PROMPTS[:1], max_new_tokens=n_new, stop_at_eos=False)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    hwm = None
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    print(json.dumps({"kind": kind, "maxrss_kb": rss, "vmhwm_kb": hwm}), flush=True)
    return 0


_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def peak_rss(
    kind: str, bundle: Path, threads: int, target: str = "native", *, bf16: bool = False
) -> dict[str, int]:
    """Peak RSS (KiB) of a fresh ``--child kind`` process (``bf16``: the protected model's base
    weights in bf16): ``ru_maxrss`` and ``/proc`` VmHWM.

    The child is started through a small launcher process: Linux carries a process's
    ``ru_maxrss`` over fork + exec, so a child forked directly from this (large) process would
    report at least this process's own peak.
    """
    cmd = [sys.executable, __file__, "--child", kind, "--bundle", str(bundle)]
    cmd += ["--child-bf16"] if bf16 else []
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *cmd, "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "SCPDR_KERNEL_TARGET": target},
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (< 5 min)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on the shared 2-core machine, multi-row matmuls with 2 "
        "threads stall waiting for a core, which makes the ratios noise)",
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per batch size")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (paper: 64)")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (paper: 32)")
    ap.add_argument("--no-general", action="store_true", help="skip timing the general path")
    ap.add_argument(
        "--no-bf16", action="store_true", help="skip timing the fast path with bf16 weights"
    )
    ap.add_argument("--only", choices=["speed", "memory"], help="run one part only")
    ap.add_argument("--memory-rounds", type=int, default=None, help="subprocess pairs (median)")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=None,
        help="cpu (default with one thread): this thread's CPU time, which other processes on a "
        "shared machine barely inflate (everything runs on it with one torch thread: torch's "
        "ops and the kernel's one-thread OpenMP region); wall (default with more threads)",
    )
    ap.add_argument(
        "--targets",
        nargs="+",
        default=None,
        help="kernel build targets (-march values) to time besides native (default on x86: "
        "x86-64-v3 when this CPU has AVX2)",
    )
    ap.add_argument("--child", choices=["single", "protected"], help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    ap.add_argument("--child-bf16", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = setup(threads=args.threads)
    if args.child:
        return child(args.child, args.bundle, CHILD_TOKENS, bf16=args.child_bf16)

    import statistics

    import torch

    from scpdr import kernels, models
    from scpdr.runtime import ProtectedLM

    targets = ["native", *(args.targets if args.targets is not None else default_targets())]
    clock = args.clock or ("cpu" if threads == 1 else "wall")
    n_new = max(2, args.new_tokens or (10 if args.quick else 32))
    repeats = args.repeats or (3 if args.quick else 5)
    mem_rounds = args.memory_rounds or (1 if args.quick else 3)
    base, tok = models.load_base()
    tmp = tempfile.TemporaryDirectory(prefix="bench-lora-")
    root = Path(tmp.name)
    bundle = build_bundle(root, base, rank=args.rank, alpha=args.alpha)
    # what `scpdr serve` decodes this bundle with (a LoRA stack over the embedded GGUF base)
    choices = decode_choices(targets, bundle, no_bf16=args.no_bf16)
    lms, packed_views = {}, {}
    for target in targets:  # one fast-path model per kernel build
        suffix = "" if target == "native" else f"[{target}]"
        with kernels.using_target(target):
            fast = ProtectedLM.from_bundle(bundle, device="cpu")
        if not fast.fast_path.on:
            raise RuntimeError(
                f"the LoRA fast path did not engage on the benchmark bundle ({fast.fast_path})"
            )
        stack = fast.runner  # the shared-base runner (scpdr.lora.StackedLoRA)
        lms[f"scp-delta-r-b{suffix}"] = (target, fast)
        if not args.no_bf16:  # the base's weights in bf16 on the same kernel (--precision bf16)
            with kernels.using_target(target):
                lms[f"{BF16}{suffix}"] = (
                    target,
                    ProtectedLM.from_bundle(bundle, dtype=torch.bfloat16, device="cpu"),
                )
        # one model through the same packed kernels as the fast path: the stack's base group
        if any(getattr(mod, "weight_packed", None) is not None for mod in stack.model.modules()):
            packed_views[f"single-packed{suffix}"] = (target, stack.views[-1])
    if not args.no_general:
        merged = [models.load_model(root / f"adapter-{i}") for i in range(2)]
        lms["general"] = ("native", ProtectedLM(merged, tok, base_model=base))
    tok.padding_side = "left"

    ratios: dict[str, float | None] = {}
    ms: dict[str, float] = {}
    end_to_end: dict[str, float] = {}
    ceilings: dict[str, float] = {}
    same_kernels: dict[str, float] = {}
    bf16w: dict[str, float] = {}
    for b in [] if args.only == "memory" else args.batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        # The ceiling of any shared-base path: one plain model decoding the (K + 1)·B stacked
        # rows (base + 2 constituents), with no adapter deltas and no aggregation.
        enc_stacked = tok(prompts * 3, return_tensors="pt", padding=True)
        fns = {}
        for n in (n_new, 1):  # decode step cost = (t(n tokens) - t(1 token)) / (n - 1)

            def hf(enc=enc, n=n):
                with torch.inference_mode():
                    base.generate(
                        **enc,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=tok.pad_token_id,
                    )

            fns[f"hf-generate/{n}"] = hf
            fns[f"hf-stacked-rows/{n}"] = partial(hf, enc_stacked, n)
            for name, (target, view) in packed_views.items():
                fns[f"{name}/{n}"] = partial(on_target, target, greedy_decode, view, enc, n)
            for name, (target, lm) in lms.items():
                if name == "general" and args.quick and b > 1:
                    continue
                fns[f"{name}/{n}"] = partial(
                    on_target, target, lm.generate, prompts, max_new_tokens=n, stop_at_eos=False
                )
        logger.info("B=%d: timing %s (%d rounds, %d new tokens)", b, list(fns), repeats, n_new)
        med = interleaved_medians(fns, repeats=repeats, warmup=1, clock=clock)
        step = {
            k[: -len(f"/{n_new}")]: (med[k] - med[k[: -len(f"/{n_new}")] + "/1"]) / (n_new - 1)
            for k in med
            if k.endswith(f"/{n_new}")
        }
        for name, sec in step.items():
            ms[f"{name}@B{b}"] = round(1000 * sec, 2)  # ms per decode step (prefill excluded)
            e2e = med[f"hf-generate/{n_new}"] / med[f"{name}/{n_new}"]
            if name == "hf-generate":
                continue
            if name == "hf-stacked-rows":
                ceilings[f"scp-delta-r-b@B{b}"] = round(step["hf-generate"] / sec, 3)
                continue
            if name.startswith("single-packed"):
                fast_name = "scp-delta-r-b" + name[len("single-packed") :]
                same_kernels[f"{fast_name}@B{b}"] = round(sec / step[fast_name], 3)
                continue
            if name.startswith(BF16):  # against HF generate, and against the fp32 weights
                fp32 = "scp-delta-r-b" + name[len(BF16) :]
                bf16w[f"{name}@B{b}"] = round(step["hf-generate"] / sec, 3)
                bf16w[f"speedup{name[len(BF16) :]}@B{b}"] = round(step[fp32] / sec, 3)
            elif name.startswith("scp-delta-r-b"):
                ratios[f"{name}@B{b}"] = round(step["hf-generate"] / sec, 3)
            else:
                ms[f"ratio:{name}@B{b}"] = round(step["hf-generate"] / sec, 3)
            end_to_end[f"{name}@B{b}"] = round(e2e, 3)

    decisions = kernels.decisions()
    del lms, packed_views
    logger.info("memory: %d round(s) of single / protected subprocesses", mem_rounds)
    # (kind, target, bf16 weights): one model, each build's protected model, and its bf16 one
    # where that is what `scpdr serve` decodes with
    runs = [("single", "native", False)]
    for t in targets:
        runs += [("protected", t, False)] + ([("protected", t, True)] if choices[t].bf16 else [])
    rss: dict[str, list[dict[str, int]]] = {memory_key(*r): [] for r in runs}
    for _ in range(0 if args.only == "speed" else mem_rounds):
        for kind, t, bf16 in runs:
            rss[memory_key(kind, t, bf16)].append(peak_rss(kind, bundle, threads, t, bf16=bf16))
    mem = {k: statistics.median([r["maxrss_kb"] for r in v] or [0]) for k, v in rss.items()}
    hwm = {k: statistics.median([r["vmhwm_kb"] or 0 for r in v] or [0]) for k, v in rss.items()}
    for (kind, t, bf16), key in ((r, memory_key(*r)) for r in runs):
        if kind == "single":
            continue
        out = bf16w if bf16 else ratios
        name = bf16_key("memory", t) if bf16 else target_key("memory", t)
        out[name] = round(mem[key] / mem["single"], 3) if mem["single"] else None
    tmp.cleanup()
    served = served_default(choices, ratios, bf16w, args.batch_sizes, no_bf16=args.no_bf16)
    isa = per_target(targets, ratios, served, same_kernels, decisions, kernels)
    float32 = {k: v for k, v in ratios.items() if "[" not in k}
    ratios, met = served["native"]["ratios"], served["native"]["goals_met"]
    for k, v in ratios.items():
        logger.info("%-20s %s  (goal %s)", k, "-" if v is None else f"{v:.3f}", GOALS.get(k))
    emit(
        "lora",
        ratios,
        goals=GOALS,
        goals_met=met,
        precision=served["native"]["precision"],
        float32_ratios=float32,
        ms_per_step=ms,
        end_to_end_ratios=end_to_end,
        stacked_rows_ceiling=ceilings,
        same_kernel_ratios=same_kernels,
        bf16_weights=bf16w,
        served_default=served,
        isa=isa,
        peak_rss_mib={k: round(v / 1024, 1) for k, v in mem.items()},
        vmhwm_mib={k: round(v / 1024, 1) for k, v in hwm.items()},
        rank=args.rank,
        new_tokens=n_new,
        threads=threads,
        clock=clock,
        cpu=cpu_model(),
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        quick=args.quick,
    )
    return 0


def on_target(target: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the kernels of build ``target`` (the SCP-Δr aggregation;
    the packed layers keep the build they were packed for)."""
    from scpdr import kernels

    with kernels.using_target(target):
        return fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
