"""The stage bodies that build an experiment's models: the tiny base, the partitions (data +
canaries + audit, LiRA's targets), constituents / reference p0 / baselines, and the bundles. Each
is a function of a :class:`~scpdr.experiment.cache.StageContext` that writes into ``ctx.dir``; the
attack, bounds and report stages are in :mod:`scpdr.experiment.stages_eval`.

The data is prepared by the library's one data preparation
(:func:`scpdr.data.prepare_partitions`, as ``scpdr train`` does) and every model trained with the
library's one :class:`scpdr.training.TrainConfig` (the YAML ``train:`` section).
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.data import CanaryConfig, prepare_partitions
from scpdr.errors import ConfigError
from scpdr.experiment.cache import StageContext
from scpdr.experiment.sections import GOLDFISH, GoldfishConfig, PartitionConfig
from scpdr.io import atomic_write_json, read_json
from scpdr.training import TrainConfig

__all__ = [
    "TARGETS_NAME",
    "baseline_singles",
    "load_pset",
    "run_bundle",
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


def run_partitions(ctx: StageContext) -> None:
    """The corpus → canaries inserted → K audited disjoint partitions
    (:func:`scpdr.data.prepare_partitions`), the bundle's audit record, and LiRA's targets."""
    inp = ctx.stage.inputs
    pcfg = PartitionConfig.model_validate(inp["partitions"])
    seed = int(inp["seed"])
    prepared = prepare_partitions(
        inp["source"],
        k=pcfg.k,
        seed=seed,
        n_train=inp["n_train"],
        n_val=inp["n_val"],
        fields=inp["fields"] or None,
        grouping=pcfg.grouping,
        canaries=CanaryConfig.model_validate(inp["canaries"]) if inp["canaries"] else None,
        out=ctx.dir / "partitions",
        overwrite=True,
        allow_failed_audit=pcfg.allow_overlap,
        override="`partitions: {allow_overlap: true}` in the config",
    )
    atomic_write_json(ctx.dir / "audit.json", prepared.audit_record())
    pset, registry = prepared.pset, prepared.pset.canaries
    # The targets of LiRA / v_x: partition-0 examples left out of the reference model p0.
    holdout = int(inp["holdout"])
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
    if ctx.stage.inputs["partition"] is None:  # one model on every partition together
        return [r for part in pset.parts for r in part]
    i = int(ctx.stage.inputs["partition"])
    records = list(pset.parts[i])
    if ctx.stage.inputs["role"] == "reference":
        drop = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
        if pset.canaries is not None:
            drop |= {r.id for r in pset.canaries.records()}
        records = [r for r in records if r.id not in drop]
    return records


def run_train(ctx: StageContext) -> None:
    """Fine-tune one model on its partition: the ``train`` section (a :class:`TrainConfig`) with
    the experiment's top-level seed, plus the goldfish loss or the DP-SGD fields
    (:class:`~scpdr.experiment.sections.DPBaselinesConfig`) for those baselines."""
    from scpdr.training import finetune

    inp = ctx.stage.inputs
    update = {"seed": int(inp["seed"]), "progress": False}
    if inp.get(GOLDFISH) is not None:
        update.update(GoldfishConfig.model_validate(inp[GOLDFISH]).train_fields())
    if inp.get("dp") is not None:
        update.update(inp["dp"])
    config = TrainConfig.from_dict({**inp["train"], **update}, what="train")
    finetune(
        _training_records(ctx),
        base=_base_ref(ctx),
        config=config,
        out=ctx.dir / "model",
        device=ctx.config.device,
    )


def baseline_singles(ctx: StageContext) -> dict[str, Path] | None:
    """The training-time baselines an attack stage evaluates as one model (goldfish, the DP rows
    trained on every partition together): ``{row: model dir}`` from the deps named after their
    rows, None when there is none."""
    names = [n for n in M.BASELINE_METHODS if M.SPECS[n].kind == "single"]
    return {n: ctx.dep(n) / "model" for n in names if n in ctx.deps} or None


def _validation_texts(pset: Any, n: int | None = None) -> list[str]:
    texts = [r.text for r in pset.clean_validation()]
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
