"""A training step of ``scpdr`` against a hand-written HF-Trainer-style step: tokens/s, padding, peak
memory (both are loops written here; the Trainer itself is not run).

On records of skewed lengths (lognormal, mean ~120 tokens, longest 262: the shape of a user's
changelog entries, 500 of them, batch 8), measured round-robin in one run (the CPU is shared):

- ``tokens_per_s``: non-pad tokens per second of scpdr's training step — length-grouped batches
  (:class:`~scpdr.training.sequences.GroupedSampler`'s order) padded per batch
  (:class:`~scpdr.training.sequences.CausalCollator`), the chunked loss
  (:class:`~scpdr.training.loss.ChunkedCausalLMLoss` on the model's hidden states) and the
  precision ``--precision`` resolves to (default ``auto``:
  :func:`~scpdr.training.precision.resolve_precision`) — divided by that of a plain HF
  Trainer-style step: batches in random order, padded per batch, the model's own loss, fp32.
  scpdr's step with the model's own loss instead of the chunked one is timed in the same
  rounds (``chunked_loss_speedup``: its time / the chunked step's; > 1: chunking is faster;
  it decides whether ``chunked_loss`` stays the default). ``lora_dropout_speedup``: torch's
  CPU dropout's time over :class:`~scpdr.training.dropout.WordDropout`'s (what LoRA training
  on CPU uses instead) on one adapter input.
  scpdr's step is timed as ``scpdr train`` runs it on CPU: with gradient checkpointing (the
  plan's default there, :func:`~scpdr.training.plan.fit_to_data`); the same step without it is
  timed beside it (``seconds_per_batch["scpdr-no-checkpointing"]``: what checkpointing costs),
  and the step without the heap's free pages returned inside it (``scpdr-no-trim-heap``, what
  ``trim_heap: false`` does; ``heap_trim_cost``: scpdr's time over its; its peak RSS beside).
  Both steps are forward, backward and an AdamW step on the same model, over ``--steps``
  batches drawn from each side's epoch; the Trainer's own per-step overhead is the same for
  both and left out. Goal >= 1.0, and >= 1.8 on a CPU with bf16 units (``amx_bf16`` or
  ``avx512_bf16``).
- ``padding_share``: pad tokens / all tokens of scpdr's batches over the whole first epoch (the
  plan's number, :func:`~scpdr.training.plan.fit_to_data`: each batch padded to its longest
  rounded up to the plan's ``pad_to_multiple_of``); the random batches' share (padded to their
  longest, as HF's collator does by default) is reported beside it. Goal <= 0.15.
- ``peak_rss_gb``: peak resident memory (``ru_maxrss``) of a fresh process that runs two full
  fine-tuning steps of the 135M model at batch 8 x 256 tokens with scpdr's step as it runs on
  CPU (AdamW, so the optimizer state is there; gradient checkpointing on); the HF step's is
  reported beside it, scpdr's without checkpointing (``--no-gradient-checkpointing``, as on
  a GPU) and with ``trim_heap: false``. Goal <= 3 GB (reported in GiB).

``--tiny`` runs everything on the tiny random model (seconds; for testing the script: its numbers
say nothing about the 135M model); ``--quick`` times fewer batches and rounds (< 5 min);
both together (the smoke test) start one peak-RSS process, scpdr's, instead of three.

    python benchmarks/bench_train.py [--quick] [--tiny] [--threads N] [--precision auto|fp32|bf16]

Last stdout line: ``{"bench": "train", "ratios": {"tokens_per_s": ..., "padding_share": ...,
"peak_rss_gb": ...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, emit, interleaved_medians, logger, setup

#: Goals: speed ratio (with bf16 units: the second), padding share, peak RSS in GB.
GOALS = {"tokens_per_s": 1.0, "tokens_per_s_bf16": 1.8, "padding_share": 0.15, "peak_rss_gb": 3.0}
#: The skewed lengths: lognormal around this mean, capped (a user's changelog entries).
MEAN_TOKENS, MAX_TOKENS = 120, 262
#: The peak-RSS processes: scpdr's step (as on CPU), HF's, scpdr's without checkpointing, and
#: with the heap's free pages kept resident (``trim_heap: false``).
RSS_KINDS = ("scpdr", "hf", "scpdr-no-checkpointing", "scpdr-no-trim-heap")
_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def _model(tiny: bool) -> tuple[Any, int]:
    """``(model in train mode, EOS id)``: the embedded 135M model, or the tiny random one."""
    if tiny:
        from scpdr.testing import tiny_model

        model = tiny_model(0)
        eos = 2
    else:
        from _common import load_embedded_model

        loaded = load_embedded_model()
        if loaded is None:
            raise SystemExit("the embedded model is not available; run with --tiny")
        model, tok = loaded
        eos = int(tok.eos_token_id)
    model.config.use_cache = False
    return model.train(), eos


def skewed_rows(n: int, *, vocab: int, eos: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` training sequences of lognormal lengths (mean ~MEAN_TOKENS, at most MAX_TOKENS),
    random tokens ending in EOS, unpadded (as ``build_sequences`` makes unpacked records)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = min(MAX_TOKENS, max(4, int(rng.lognormvariate(4.65, 0.45))))
        ids = [rng.randrange(3, vocab) for _ in range(length - 1)] + [eos]
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": list(ids)})
    return rows


def lora_dropout_speedup(*, repeats: int) -> float:
    """``F.dropout``'s time / :class:`~scpdr.training.dropout.WordDropout`'s on the input of a
    135M MLP projection at 8 x 256 tokens (2048 x 1536, bf16 as under autocast), p = 0.05,
    interleaved medians: what replacing LoRA's dropout on CPU saves per adapter (> 1: faster)."""
    import torch

    from scpdr.training.dropout import WordDropout

    x = torch.randn(2048, 1536).to(torch.bfloat16)
    ours = WordDropout(0.05).train()

    def run(f: Any) -> Any:
        return lambda: [f() for _ in range(10)]

    med = interleaved_medians(
        {
            "torch": run(lambda: torch.nn.functional.dropout(x, 0.05, True)),
            "scpdr": run(lambda: ours(x)),
        },
        repeats=repeats,
        warmup=1,
    )
    return med["torch"] / med["scpdr"]


def _plan(lengths: list[int], batch: int, precision: Any) -> Any:
    """The plan ``scpdr train`` makes on CPU for records of these lengths at this batch, in
    this precision (a :class:`~scpdr.training.precision.PrecisionChoice`)."""
    from scpdr.training.plan import fit_to_data

    config = {"batch_size": batch, "packing": False, "seq_len": max(lengths)}
    return fit_to_data(config, lengths, precision=precision, device="cpu")[1]


def cpu_checkpointing() -> bool:
    """Whether ``scpdr train`` checkpoints activations on CPU by default (the plan decides)."""
    from scpdr.training.plan import fit_to_data

    return fit_to_data({}, [256] * 8, device="cpu")[1].gradient_checkpointing


def cpu_trim_heap() -> bool:
    """Whether ``scpdr train`` trims the heap inside each step on CPU by default."""
    from scpdr.training.config import TrainConfig

    return TrainConfig().trim_heap


def _steps(
    model: Any,
    precision: Any,
    *,
    ours: bool,
    chunked: bool = True,
    checkpointing: bool = False,
    trim: bool = False,
) -> Any:
    """One training step on a collated batch: scpdr's (chunked loss unless ``chunked`` is
    false, the precision under the Trainer's autocast settings, activations checkpointed if
    ``checkpointing``, the heap trimmed after the forward and before the optimizer step if
    ``trim``) or HF's (the model's own loss, fp32, no checkpointing). The same AdamW for both,
    as the Trainer runs it on CPU (its cost does not depend on the weights' values); each step
    sets the model's checkpointing, so sides can share a model."""
    import contextlib

    import torch

    from scpdr.training.loss import ChunkedCausalLMLoss
    from scpdr.training.memory import AUTOCAST_CACHE, trim_at_layers, trim_step_heap
    from scpdr.training.placement import FALLBACK_OPTIM, resolve_optim

    # as the Trainer runs AdamW on CPU: torch's fused kernel where it runs (scpdr's choice and
    # transformers' own default, scpdr.training.placement.resolve_optim)
    fused = resolve_optim(FALLBACK_OPTIM, "cpu") != FALLBACK_OPTIM
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-7, fused=fused or None)
    loss_fn = ChunkedCausalLMLoss(
        model.get_output_embeddings(),
        vocab_size=int(model.config.vocab_size),
        autocast="cpu" if precision.bf16 else None,
        trim_heap=ours and trim,  # as trim_heap: true on CPU (scpdr.training.memory)
    )

    def step(batch: dict[str, Any]) -> None:
        if checkpointing and ours:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        elif model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        # the heap trim callback's hooks, on this side's steps only (sides may share a model)
        hooks = trim_at_layers(model) if ours and trim else []
        if ours:
            ctx = (
                torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=AUTOCAST_CACHE)
                if precision.bf16
                else contextlib.nullcontext()
            )
            if chunked:
                with ctx:  # the Trainer's bf16 autocast wraps the forward
                    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
                n = int((batch["labels"][:, 1:] != -100).sum())
                loss = loss_fn(out, batch["labels"], n)
            else:
                with ctx:
                    loss = model(**inputs, labels=batch["labels"]).loss
        else:
            loss = model(**inputs, labels=batch["labels"]).loss
        loss.backward()
        for h in hooks:
            h.remove()
        if ours and trim:  # the heap trim callback's on_pre_optimizer_step
            trim_step_heap()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def child(kind: str, tiny: bool, precision_name: str, threads: int) -> None:
    """Two training steps at batch 8 x 256 tokens (``scpdr``: as on CPU, ``hf``,
    ``scpdr-no-checkpointing`` or ``scpdr-no-trim-heap``); prints ``{"maxrss_kb": ...}``."""
    import torch

    from scpdr.training.precision import resolve_precision
    from scpdr.training.sequences import CausalCollator

    torch.set_num_threads(threads)
    model, eos = _model(tiny)
    ours = kind.startswith("scpdr")
    precision = resolve_precision(precision_name if ours else "fp32")
    rows = skewed_rows(8, vocab=int(model.config.vocab_size), eos=eos, seed=1)
    for r in rows:  # full length: 256 tokens each
        r["input_ids"] = (r["input_ids"] * 256)[:256]
        r["attention_mask"], r["labels"] = [1] * 256, list(r["input_ids"])
    batch = CausalCollator(pad_token_id=eos)(rows)
    checkpointing = kind in ("scpdr", "scpdr-no-trim-heap") and cpu_checkpointing()
    trim = kind in ("scpdr", "scpdr-no-checkpointing") and cpu_trim_heap()
    step = _steps(model, precision, ours=ours, checkpointing=checkpointing, trim=trim)
    for _ in range(2):
        step(batch)
    print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def peak_rss_kb(kind: str, *, tiny: bool, precision: str, threads: int) -> int:
    """``ru_maxrss`` of a fresh ``--child kind`` process, started through a launcher (Linux
    carries ``ru_maxrss`` over fork + exec: a child of this process would report its peak)."""
    cmd = [sys.executable, __file__, "--child", kind, "--precision", precision]
    cmd += ["--threads", str(threads), *(["--tiny"] if tiny else [])]
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *cmd], check=True, capture_output=True, text=True
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["maxrss_kb"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and rounds (< 5 min)")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (tests)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    ap.add_argument("--records", type=int, default=500, help="records of the epoch")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=None, help="timed batches per side")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds")
    ap.add_argument("--child", choices=(*RSS_KINDS,), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    threads = setup(threads=args.threads)
    if args.child:
        child(args.child, args.tiny, args.precision, threads)
        return 0

    import torch

    from scpdr.training.precision import bf16_units, cpu_flags, resolve_precision
    from scpdr.training.sequences import CausalCollator, epoch_order, padding_share

    steps = args.steps or (8 if not args.quick else 2 if args.tiny else 3)
    repeats = args.repeats or (3 if not args.quick else 1 if args.tiny else 2)
    precision = resolve_precision(args.precision)
    units = bf16_units(cpu_flags())
    logger.info("precision %s", precision.summary)

    model, eos = _model(args.tiny)
    rows = skewed_rows(args.records, vocab=int(model.config.vocab_size), eos=eos)
    lengths = [len(r["input_ids"]) for r in rows]
    orders = {
        "scpdr": epoch_order(lengths, batch_size=args.batch, seed=0, grouped=True),
        "hf": epoch_order(lengths, batch_size=args.batch, seed=0, grouped=False),
    }
    # scpdr pads each batch to a multiple of the plan's (as scpdr train does), HF to its longest
    multiple = {"scpdr": _plan(lengths, args.batch, precision).pad_to_multiple_of, "hf": 1}
    shares = {k: padding_share(lengths, o, args.batch, multiple[k]) for k, o in orders.items()}
    rng = random.Random(0)
    n_batches = len(rows) // args.batch
    picked = sorted(rng.sample(range(n_batches), min(steps, n_batches)))
    batches = {
        k: [
            CausalCollator(pad_token_id=eos, pad_to_multiple_of=multiple[k])(
                [rows[i] for i in o[b * args.batch : (b + 1) * args.batch]]
            )
            for b in picked
        ]
        for k, o in orders.items()
    }  # the same batch positions of each side's epoch
    tokens = {k: sum(int(b["attention_mask"].sum()) for b in bs) for k, bs in batches.items()}
    fns = {}
    ckpt, trim = cpu_checkpointing(), cpu_trim_heap()
    sides = {  # (batches, chunked loss, checkpointing, heap trimmed)
        "hf": ("hf", False, False, False),
        "scpdr": ("scpdr", True, ckpt, trim),
        "scpdr-model-loss": ("scpdr", False, ckpt, trim),
        "scpdr-no-checkpointing": ("scpdr", True, False, trim),
        "scpdr-no-trim-heap": ("scpdr", True, ckpt, False),
    }
    for kind, (data, chunked, checkpointing, trimmed) in sides.items():
        step = _steps(
            model,
            precision,
            ours=kind != "hf",
            chunked=chunked,
            checkpointing=checkpointing,
            trim=trimmed,
        )
        fns[kind] = lambda step=step, bs=batches[data]: [step(b) for b in bs]
    logger.info("timing %d batches per side, %d rounds, %d threads", len(picked), repeats, threads)
    med = interleaved_medians(fns, repeats=repeats, warmup=1)
    tps = {k: tokens[sides[k][0]] / med[k] for k in med}
    dropout_speedup = lora_dropout_speedup(repeats=max(repeats, 3))
    del model, fns, batches
    # the smoke test (--tiny --quick) starts one RSS process, scpdr's (the goal's figure)
    kinds = RSS_KINDS[:1] if args.tiny and args.quick else RSS_KINDS
    rss = {
        k: peak_rss_kb(k, tiny=args.tiny, precision=args.precision, threads=threads) for k in kinds
    }
    ratios = {
        "tokens_per_s": round(tps["scpdr"] / tps["hf"], 3),
        "padding_share": round(shares["scpdr"], 4),
        "peak_rss_gb": round(rss["scpdr"] / 2**20, 3),
    }
    speed_goal = GOALS["tokens_per_s_bf16" if units else "tokens_per_s"]
    goals = {
        "tokens_per_s": speed_goal,
        "padding_share": GOALS["padding_share"],
        "peak_rss_gb": GOALS["peak_rss_gb"],
    }
    met = {
        "tokens_per_s": ratios["tokens_per_s"] >= speed_goal,
        "padding_share": ratios["padding_share"] <= GOALS["padding_share"],
        "peak_rss_gb": ratios["peak_rss_gb"] <= GOALS["peak_rss_gb"],
    }
    for k, v in ratios.items():
        logger.info("%-15s %.3f  (goal %s)", k, v, goals[k])
    emit(
        "train",
        ratios,
        goals=goals,
        goals_met=met,
        tokens_per_s={k: round(v, 1) for k, v in tps.items()},
        seconds_per_batch={k: round(med[k] / len(picked), 4) for k in med},
        chunked_loss_speedup=round(med["scpdr-model-loss"] / med["scpdr"], 3),
        checkpointing=ckpt,
        trim_heap=trim,
        lora_dropout_speedup=round(dropout_speedup, 3),
        checkpointing_cost=round(med["scpdr"] / med["scpdr-no-checkpointing"], 3),
        heap_trim_cost=round(med["scpdr"] / med["scpdr-no-trim-heap"], 3),
        padding_share={k: round(v, 4) for k, v in shares.items()},
        peak_rss_gb={k: round(v / 2**20, 3) for k, v in rss.items()},
        precision=precision.to_dict(),
        bf16_units=list(units),
        model="tiny" if args.tiny else "SmolLM2-135M",
        records=args.records,
        batch=args.batch,
        timed_batches=len(picked),
        repeats=repeats,
        threads=threads,
        torch=torch.__version__,
        load_average=os.getloadavg()[0],
        cpu=cpu_model(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
