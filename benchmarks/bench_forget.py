"""Forgetting on the demo's names, end to end: `scpdr forget` against `scpdr train`.

Trains the demo-sized bundle (configs/demo.yaml: names2ids, 40 training names and 48 validation
names, K partitions, its `train:` section and seed) with `scpdr train`'s library
calls (`prepare_partitions` + `train_bundle`), forgets 10 names of partition 0
(`scpdr.training.forget.forget_records`), and checks the acceptance:

- only constituent 0 was trained again: every file of constituent 1 has the same sha256;
- No CP (constituent 0 alone) extracts the 10 IDs before (FER with its 95% interval) and none
  after (FER 0), on the same attack (`scpdr eval B2 --forgotten`'s pipeline,
  `scpdr.attacks.forgotten.eval_forgotten`);
- after, Ref and LiRA on the forgotten names are not distinguishable from the validation row
  (the same test on validation names no model saw);
- time: forget ≤ train / K + the copy (the baseline, `scpdr train`, measured in the same run);
  also against the retrained partition's share of the optimizer steps (the demo's partition 0
  holds every canary, so it is more than 1/K of the training).

    python benchmarks/bench_forget.py [--quick] [--canaries] [--base tiny] [--device cuda] [--work DIR]

By default the bundle is what `scpdr train` makes of the demo's names (no canaries: they are the
experiment's instrument, not a user's data), so the two partitions hold 20 names each.
`--canaries` adds the demo's canaries, which all sit in partition 0 (66 of its 86 training
records): forgetting there retrains most of the training, and the step-share bound is the one
that applies.

`--base tiny` runs the same steps on a tiny random model (seconds; for testing the script: its
numbers say nothing about memorization). `--quick` trains a third of the demo's epochs.
Last stdout line: ``{"bench": "forget", "ratios": {"forget_over_train": ...}, ...}``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, emit, setup

#: Names forgotten (the acceptance's 10 names of partition 0).
N_FORGOTTEN = 10
ROOT = Path(__file__).resolve().parents[1]


def _sha(d: Path) -> dict[str, str]:
    return {
        f.relative_to(d).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(d.rglob("*"))
        if f.is_file()
    }


def _row(rows: list[Any], bundle: str, method: str, attack: str, metric: str) -> dict | None:
    for r in rows:
        if (r.extra.get("bundle"), r.method, r.attack, r.metric) == (
            bundle,
            method,
            attack,
            metric,
        ):
            d = r.to_dict()
            return {k: d.get(k) for k in ("value", "ci_low", "ci_high", "n")}
    return None


def _steps(model_dir: Path) -> int:
    """Optimizer steps of a finished run (its ``train_info.json``)."""
    import json

    return int(json.loads((model_dir / "train_info.json").read_text())["global_step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a third of the demo's epochs")
    ap.add_argument("--base", default=None, help="base model (default: the demo's); tiny: tests")
    ap.add_argument(
        "--canaries", action="store_true", help="add the demo's canaries (all in partition 0)"
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if any)")
    ap.add_argument("--work", type=Path, default=None, help="work dir (default: a temp dir)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    args = ap.parse_args()
    threads = setup()

    from scpdr.attacks.evaluation import EvalOptions
    from scpdr.attacks.forgotten import eval_forgotten
    from scpdr.attacks.results import NO_CP_VAL
    from scpdr.attacks.stats import Estimate, distinguishable
    from scpdr.data import prepare_partitions
    from scpdr.device import resolve_device
    from scpdr.experiment import load_config
    from scpdr.training import TrainConfig, train_bundle
    from scpdr.training.forget import forget_records

    cfg = load_config(args.config)
    corpus = cfg.corpora[0]
    base = args.base or cfg.base
    device = resolve_device(args.device)
    train = cfg.train.model_dump(mode="json", exclude={"seed", "progress"})
    train.update(seed=cfg.seed, progress=False)
    if args.quick:
        train["epochs"] = max(1.0, float(train["epochs"] or 3) / 3)
    if base == "tiny":  # the script's own test: a few steps of a random model
        train.update(max_steps=4, save_steps=2)
    config = TrainConfig.from_dict(train)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-forget-"))
    work.mkdir(parents=True, exist_ok=True)
    base_ref = base
    if base == "tiny":
        from scpdr.tiny import tiny_model, tiny_tokenizer

        base_ref = str(work / "tiny-base")
        tiny_model(cfg.seed).save_pretrained(base_ref)
        tiny_tokenizer().save_pretrained(base_ref)

    # the baseline: `scpdr train` (partitions, K constituents, the bundle)
    t0 = time.perf_counter()
    prepared = prepare_partitions(
        corpus.source or corpus.name,
        k=cfg.partitions.k,
        seed=cfg.seed,
        n_train=corpus.n_train,
        n_val=corpus.n_val,
        grouping=cfg.partitions.grouping,
        canaries=corpus.canaries if args.canaries else None,
    )
    b = train_bundle(prepared, base=base_ref, config=config, out=work / "B", device=device)
    train_s = time.perf_counter() - t0
    pset = prepared.pset
    k = pset.k

    canary_ids = {r.id for r in pset.canaries.records()} if pset.canaries is not None else set()
    names = [r.id for r in pset.parts[0] if r.id not in canary_ids and r.prompt]
    ids = sorted(random.Random(f"bench-forget:{cfg.seed}").sample(names, N_FORGOTTEN))
    before_c1 = _sha(b / "constituent-1")

    t0 = time.perf_counter()
    result = forget_records(b, ids=ids, out=work / "B2", device=device)
    forget_s = time.perf_counter() - t0
    unchanged = _sha(work / "B2" / "constituent-1") == before_c1

    t0 = time.perf_counter()
    options = EvalOptions(batch_size=cfg.attacks.batch_size, seed=cfg.seed)
    rows = eval_forgotten(
        work / "B2", methods=["none"], attacks=("pii", "mia"), options=options, device=device
    )
    eval_s = time.perf_counter() - t0
    fer = {w: _row(rows, w, "none", "pii", "fer") for w in ("before", "after")}
    fer_val = _row(rows, "after", NO_CP_VAL, "pii", "fer")
    mia: dict[str, Any] = {}
    for attack in ("ref", "lira"):
        a, v = (
            _row(rows, "after", "none", attack, "auc"),
            _row(rows, "after", NO_CP_VAL, attack, "auc"),
        )
        same = None
        if a and v:

            def est(x: dict) -> Estimate:
                nan = float("nan")
                lo, hi = x["ci_low"], x["ci_high"]
                return Estimate(
                    x["value"], nan if lo is None else lo, nan if hi is None else hi, x["n"]
                )

            d = distinguishable(est(a), est(v))
            same = None if d is None else not d
        before = _row(rows, "before", "none", attack, "auc")
        mia[attack] = {"before": before, "after": a, "validation_after": v, "within_ci": same}

    bound = train_s / k + result.seconds["copy"]
    # SISA's cost is the retrained partition's share of the training, not 1/K when the
    # partitions differ in size (the demo's canaries all sit in partition 0): its optimizer steps
    steps = [_steps(b / f"constituent-{i}") for i in range(k)]
    retrained_steps = sum(_steps(work / "B2" / f"constituent-{i}") for i in result.retrained)
    share = retrained_steps / sum(steps)
    share_bound = train_s * share + result.seconds["copy"]
    checks = {
        "only_constituent_0_retrained": result.retrained == [0] and unchanged,
        "constituent_1_sha256_unchanged": unchanged,
        "no_cp_fer_after_is_0": fer["after"] is not None and fer["after"]["value"] == 0.0,
        "no_cp_fer_before": fer["before"],
        "no_cp_fer_after": fer["after"],
        "no_cp_fer_validation_after": fer_val,
        "mia_after_within_ci_of_validation": {a: m["within_ci"] for a, m in mia.items()},
        "forget_within_train_over_k_plus_copy": forget_s <= bound,
        "forget_within_train_step_share_plus_copy": forget_s <= share_bound,
    }
    emit(
        "forget",
        {
            "forget_over_train": forget_s / train_s,
            "forget_over_train_per_constituent": forget_s / (train_s / k),
        },
        seconds={
            "train": train_s,
            "forget": forget_s,
            "forget_steps": result.seconds,
            "bound_train_over_k_plus_copy": bound,
            "bound_train_step_share_plus_copy": share_bound,
            "eval_forgotten": eval_s,
        },
        k=k,
        steps={"train": steps, "forget": retrained_steps, "share": share},
        forgotten=len(ids),
        checks=checks,
        mia=mia,
        base=base,
        device=device,
        quick=args.quick,
        canaries=args.canaries,
        threads=threads,
        cpu=cpu_model(),
        work=str(work),
    )


if __name__ == "__main__":
    main()
