"""The stage bodies that build an experiment's models: the tiny base, data, partitions (+ audit,
LiRA's targets), constituents / reference p0 / baselines, and the bundles. Each is a function of
a :class:`~scpdr.experiment.cache.StageContext` that writes into ``ctx.dir``; the attack, bounds and
report stages are in :mod:`scpdr.experiment.stages_eval`.

The experiment's train section and data preparation here are its own (``TrainSection``); the
library's ``TrainConfig`` / ``prepare_partitions`` will replace them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scpdr.errors import ConfigError
from scpdr.experiment.cache import StageContext
from scpdr.experiment.sections import BUILTIN_CORPORA, GOLDFISH, PartitionConfig, TrainSection
from scpdr.io import atomic_write_json, read_json

__all__ = [
    "TARGETS_NAME",
    "load_pset",
    "run_bundle",
    "run_data",
    "run_partitions",
    "run_ref_bundle",
    "run_tiny_base",
    "run_train",
]

logger = logging.getLogger(__name__)

TARGETS_NAME = "targets.json"
"""The partitions stage's list of LiRA's targets: partition-0 examples p0 is trained without."""


def run_tiny_base(ctx: StageContext) -> None:
    from scpdr.tiny import tiny_model, tiny_tokenizer

    model = tiny_model(int(ctx.stage.inputs["seed"]))
    model.save_pretrained(str(ctx.dir / "model"))
    tiny_tokenizer().save_pretrained(str(ctx.dir / "model"))


def _base_ref(ctx: StageContext) -> str:
    if "base" in ctx.deps:
        return str(ctx.deps["base"] / "model")
    return ctx.config.base


def run_data(ctx: StageContext) -> None:
    import random

    from scpdr.data import CanaryConfig as DataCanaryConfig
    from scpdr.data import build_corpus, load_records, make_canaries, save_records

    inp = ctx.stage.inputs
    source, n_train, n_val, seed = inp["source"], inp["n_train"], inp["n_val"], inp["seed"]
    if source in BUILTIN_CORPORA:
        corpus = build_corpus(source, n_train=n_train, n_val=n_val, seed=seed)
        train, val = corpus.train, corpus.validation
    else:
        records = load_records(source, fields=inp["fields"] or None)
        rng = random.Random(f"experiment-data:{seed}")
        order = list(range(len(records)))
        rng.shuffle(order)
        if len(records) < n_val + 2:
            raise ConfigError(
                f"{source} has {len(records)} records; need more than n_val + 1 = {n_val + 1}"
            )
        val = [records[i] for i in order[:n_val]]
        train = [records[i] for i in order[n_val : n_val + n_train]]
        if len(train) < n_train:
            logger.warning("%s: only %d training records (n_train=%d)", source, len(train), n_train)
    save_records(ctx.dir / "train.jsonl", train)
    save_records(ctx.dir / "validation.jsonl", val)
    can = inp["canaries"]
    if can is not None:
        registry = make_canaries(
            DataCanaryConfig(
                n_per_repetition=can["n_per_repetition"],
                repetitions=tuple(can["repetitions"]),
                num_words=can["num_words"],
                partition=can["partition"],
                seed=seed,
            )
        )
        registry.save(ctx.dir / "canaries.json")
    atomic_write_json(ctx.dir / "meta.json", {"n_train": len(train), "n_val": len(val)})


def run_partitions(ctx: StageContext) -> None:
    import random

    from scpdr.data import (
        CanaryRegistry,
        GroupingConfig,
        audit_partitions,
        load_records,
        partition_records,
        save_partitions,
    )

    pcfg = PartitionConfig.model_validate(ctx.stage.inputs["partitions"])
    seed = int(ctx.stage.inputs["seed"])
    data = ctx.dep("data")
    train = load_records(data / "train.jsonl")
    val = load_records(data / "validation.jsonl")
    registry = (
        CanaryRegistry.load(data / "canaries.json") if (data / "canaries.json").exists() else None
    )
    grouping = GroupingConfig(threshold=pcfg.near_duplicate_threshold, num_perm=pcfg.num_perm)
    pset = partition_records(
        train,
        k=pcfg.k,
        seed=seed,
        grouping=grouping,
        canaries=registry,
        validation=val,
        dataset={"records": str(data / "train.jsonl")},
    )
    audit = audit_partitions(pset.manifest, pset.records(), canaries=registry)
    audit_dict = audit.to_dict()
    audit_dict["overridden"] = bool(pcfg.allow_overlap and not audit.passed)
    atomic_write_json(ctx.dir / "audit.json", audit_dict)
    if not audit.passed:
        if not pcfg.allow_overlap:
            audit.raise_if_failed("`partitions: {allow_overlap: true}` in the config")
        logger.warning("partition audit FAILED; continuing because partitions.allow_overlap is set")
    save_partitions(ctx.dir / "partitions", pset)
    # The targets of LiRA / v_x: partition-0 examples left out of the reference model p0.
    holdout = int(ctx.stage.inputs["holdout"])
    canary_ids = {r.id for r in registry.records()} if registry is not None else set()
    pool = [r.id for r in pset.parts[0] if r.id not in canary_ids]
    rng = random.Random(f"experiment-targets:{seed}")
    rng.shuffle(pool)
    if holdout and len(pool) <= holdout:
        raise ConfigError(
            f"references.holdout: must be < the {len(pool)} non-canary examples of partition 0 "
            f"(got {holdout}); raise n_train or lower the holdout"
        )
    atomic_write_json(ctx.dir / TARGETS_NAME, {"holdout": sorted(pool[:holdout])})


def load_pset(path: Path) -> Any:
    from scpdr.data import load_partitions

    return load_partitions(path / "partitions")


def _training_records(ctx: StageContext) -> list[Any]:
    pset = load_pset(ctx.dep("partitions"))
    i = int(ctx.stage.inputs["partition"])
    records = list(pset.parts[i])
    if ctx.stage.inputs["role"] == "reference":
        drop = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
        if pset.canaries is not None:
            drop |= {r.id for r in pset.canaries.records()}
        records = [r for r in records if r.id not in drop]
    return records


def run_train(ctx: StageContext) -> None:
    from scpdr import train as T

    records = _training_records(ctx)
    tcfg = TrainSection.model_validate(ctx.stage.inputs["train"])
    goldfish = ctx.stage.inputs.get(GOLDFISH)
    config = _train_config(T, tcfg, goldfish=goldfish, seed=int(ctx.stage.inputs["seed"]))
    T.finetune(records, base=_base_ref(ctx), config=config, out=ctx.dir / "model")


def _train_config(
    T: Any, tcfg: TrainSection, *, goldfish: Mapping[str, Any] | None, seed: int
) -> Any:
    """Map the experiment's train section onto ``scpdr.train.TrainConfig``."""
    fields: dict[str, Any] = {
        "lora": tcfg.lora,
        "grad_accum": tcfg.grad_accum,
        "seq_len": tcfg.seq_len,
        "warmup_steps": tcfg.warmup_steps,
        "max_grad_norm": tcfg.max_grad_norm,
        "lora_r": tcfg.lora_r,
        "lora_alpha": tcfg.lora_alpha,
        "lora_dropout": tcfg.lora_dropout,
        "seed": seed,
        "progress": False,
    }
    for name in ("epochs", "learning_rate", "batch_size", "packing", "neftune_alpha"):
        value = getattr(tcfg, name)
        if value is not None:
            fields[name] = value
    if tcfg.max_steps is not None:
        fields["max_steps"] = tcfg.max_steps
    if goldfish is not None:
        fields.update(goldfish=True, goldfish_k=goldfish["k"], goldfish_h=goldfish["h"])
    fields.update(tcfg.extra)
    try:
        return T.TrainConfig(**fields)
    except ValueError as exc:
        raise ConfigError(f"train: {exc}") from None


def _validation_texts(pset: Any, n: int | None = None) -> list[str]:
    texts = [r.text for r in pset.validation]
    return texts[:n] if n is not None else texts


def run_bundle(ctx: StageContext) -> None:
    from scpdr.models import constant_base_vector, load_model, load_tokenizer, write_bundle

    pset = load_pset(ctx.dep("partitions"))
    base = _base_ref(ctx)
    prompts = _validation_texts(pset, int(ctx.stage.inputs["n_constant_prompts"]))
    base_model = load_model(base)
    vec = constant_base_vector(base_model, load_tokenizer(base), prompts)
    del base_model
    k = sum(1 for r in ctx.deps if re.fullmatch(r"c\d+", r))
    write_bundle(
        ctx.dir / "bundle",
        base=base,
        constituents=[ctx.dep(f"c{i}") / "model" for i in range(k)],
        partition_manifest_hash=pset.manifest.sha256(),
        audit=read_json(ctx.dep("partitions") / "audit.json"),
        constant_base=vec,
        extra={"experiment": ctx.config.name},
    )


def run_ref_bundle(ctx: StageContext) -> None:
    from scpdr.models import load_constant_base, read_bundle, write_bundle

    main = ctx.dep("main") / "bundle"
    manifest = read_bundle(main)
    k = sum(1 for r in ctx.deps if re.fullmatch(r"c\d+", r))
    write_bundle(
        ctx.dir / "bundle",
        base=manifest.resolve(main, manifest.base) if manifest.base else None,
        constituents=[ctx.dep(f"c{i}") / "model" for i in range(k)],
        constant_base=load_constant_base(main, manifest),
        extra={"experiment": ctx.config.name, "reference_for": str(main)},
    )
