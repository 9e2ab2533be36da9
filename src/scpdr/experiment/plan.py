"""The stage graph of an experiment: config → stages (:func:`plan`).

::

    partitions (data + canaries + audit) → train constituents (+ reference / baseline models)
         → bundles → attacks (one stage per corpus × method × attack) → bounds → report

A sweep re-plans the experiment at each of its values; a stage whose hash equals the main run's is
the same stage (run once). :class:`StageGraph` orders the stages so that every stage follows the
stages it depends on, and tells an executor which stages are ready.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.errors import ConfigError, ScpdrError
from scpdr.experiment.cache import Stage
from scpdr.experiment.config import ExperimentConfig, validate_config
from scpdr.experiment.sections import BUILTIN_CORPORA, GOLDFISH, CorpusConfig, SweepConfig
from scpdr.experiment.stages import (
    run_bundle,
    run_partitions,
    run_ref_bundle,
    run_tiny_base,
    run_train,
)
from scpdr.experiment.stages_budget import run_budget
from scpdr.experiment.stages_eval import run_attack, run_bounds, run_report

__all__ = ["StageGraph", "matches_stage", "plan", "topological"]


def _stage_inputs_corpus(cfg: ExperimentConfig, corpus: CorpusConfig) -> dict[str, Any]:
    return {
        "source": corpus.resolved_source,
        "source_fingerprint": _source_fingerprint(corpus.resolved_source),
        "n_train": corpus.n_train,
        "n_val": corpus.n_val,
        "fields": corpus.fields,
        "canaries": corpus.canaries.model_dump() if corpus.canaries else None,
        "seed": cfg.seed,
    }


def _source_fingerprint(source: str) -> str | None:
    """Size and mtime of a user data file (a changed file re-runs the partitions stage)."""
    if source in BUILTIN_CORPORA:
        return None
    p = Path(source).expanduser()
    if p.is_file():
        st = p.stat()
        return f"{st.st_size}:{int(st.st_mtime)}"
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return hashlib.sha256(
            "".join(
                f"{f.relative_to(p)}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files
            ).encode()
        ).hexdigest()
    return None


def decode_dtype_input(
    precision: str, device: str | None, *, lora: bool, base: str
) -> dict[str, str]:
    """The ``dtype`` input of the attack, bounds and budget stages: ``{"dtype": "bfloat16"}``
    (or ``"float32"``) where ``precision``, resolved here as ``scpdr serve --precision``
    resolves it for the bundle the run trains (:func:`scpdr.serve.precision.decode_dtype`: LoRA
    adapters over ``base`` if ``lora``, else full models with ``base`` as SCP-Δr-b's base), loads
    the models in another dtype than ``device``'s default (float32 on CPU, bf16 on CUDA); else
    ``{}``, so that the stages' hashes are those of the default."""
    import torch

    from scpdr.device import device_source, is_cuda, model_dtype
    from scpdr.lora import gguf_file
    from scpdr.serve.precision import DecodeForm, decode_dtype

    # the device by name (a run planned here may resume where CUDA is: none is required here)
    dev = device_source(device)[0] or ("cuda" if torch.cuda.is_available() else "cpu")
    default = model_dtype(dev) or torch.float32
    if is_cuda(dev):
        chosen = torch.float32 if precision == "fp32" else default
    else:
        form = DecodeForm(stacked=lora, gguf_base=gguf_file(base) is not None)
        chosen = decode_dtype(precision, "cpu", form=form) or default
    return {} if chosen == default else {"dtype": str(chosen).removeprefix("torch.")}


def _train_inputs(cfg: ExperimentConfig) -> dict[str, Any]:
    # train.seed and train.progress are the stage's: the top-level seed, no progress bars
    train = cfg.train.model_dump(mode="json", exclude={"seed", "progress"})
    return {"train": train, "base": cfg.base, "seed": cfg.seed}


@dataclasses.dataclass
class _CorpusStages:
    corpus: CorpusConfig
    partitions: Stage
    constituents: list[Stage]
    bundle: Stage
    reference: Stage | None = None
    ref_bundle: Stage | None = None
    goldfish: Stage | None = None
    #: DP rows: the model stage of a "single" row, the bundle stage of a "retrained" one
    dp: dict[str, Stage] = dataclasses.field(default_factory=dict)
    dp_constituents: list[Stage] = dataclasses.field(default_factory=list)


def plan(cfg: ExperimentConfig) -> tuple[list[Stage], Stage]:
    """All stages of ``cfg`` (main run and sweep points) and the report stage."""
    base_stage = _base_stage(cfg)
    main = _plan_point(cfg, base_stage)
    sources: list[tuple[str, Stage, dict[str, Any]]] = [(s.name, s, {}) for s in main]
    stages = list(main)
    main_keys = {s.key for s in main}
    for i, sweep in enumerate(cfg.sweeps):
        for value in sweep.values:
            point_cfg = _sweep_point(cfg, sweep, value, where=f"sweeps.{i}")
            point = _plan_point(point_cfg, _base_stage(point_cfg))
            tag = {"sweep": sweep.key, "sweep_value": value}
            for st in point:
                if st.key not in main_keys:
                    st.meta.setdefault("label", f"{st.name} [{sweep.key}={value}]")
            stages += point
            sources += [(f"sweep{i}={value!s}:{s.name}", s, tag) for s in point]
    result_stages = [(role, s, tag) for role, s, tag in sources if s.kind in ("attack", "bounds")]
    report = Stage(
        name="report",
        kind="report",
        inputs={
            "report": cfg.report.model_dump(),
            "title": cfg.report.title or cfg.name,
            "labels": {c.name: c.resolved_label for c in cfg.corpora},
            "methods": cfg.all_methods,
            "generation_methods": cfg.attacks.generations.methods,
            "tags": {role: tag for role, _, tag in result_stages},
            "summary": _summary(cfg),
        },
        run=run_report,
        deps={role: s for role, s, _ in result_stages},
    )
    return stages, report


def _summary(cfg: ExperimentConfig) -> str:
    corpora = ", ".join(
        f"{c.resolved_label} ({c.resolved_source}, {c.n_train} train / {c.n_val} val"
        + (f", canaries ×{list(c.canaries.repetitions)}" if c.canaries else "")
        + ")"
        for c in cfg.corpora
    )
    t = cfg.train.resolved()
    mode = "LoRA" if t.lora else "full fine-tuning"
    steps = f", max {t.max_steps} steps" if t.max_steps else ""
    dp = ""
    if cfg.baselines.dp is not None:
        eps = sorted({M.SPECS[m].dp_epsilon or 0.0 for m in cfg.baselines.dp.methods})
        dp = (
            f" DP baselines: LoRA with DP-SGD at ε ∈ {{{', '.join(f'{e:g}' for e in eps)}}} "
            "(PRV accountant, δ = 1/n unless set), recorded per model in train_info.json."
        )
    return (
        f"Base model: {cfg.base}. Data: {corpora}. K = {cfg.partitions.k} partitions; {mode}, "
        f"{t.epochs:g} epochs, lr {t.learning_rate:g}{steps}. Smoothing m = {cfg.m}.{dp}"
    )


def _sweep_point(
    cfg: ExperimentConfig, sweep: SweepConfig, value: Any, *, where: str
) -> ExperimentConfig:
    try:
        point = cfg.with_value(sweep.key, value)
    except ConfigError as exc:
        raise ConfigError(
            f"{where}: value {value!r} for {sweep.key!r} is invalid:\n{exc}"
        ) from None
    data = point.model_dump()
    data["sweeps"] = []
    if sweep.methods is not None:
        data["methods"] = [m for m in point.methods if m in sweep.methods]
        if GOLDFISH not in sweep.methods:
            data["baselines"][GOLDFISH] = None  # the baseline's section is named after its row
        if data["baselines"].get("dp") is not None:
            kept = [m for m in data["baselines"]["dp"]["methods"] if m in sweep.methods]
            data["baselines"]["dp"] = {**data["baselines"]["dp"], "methods": kept} if kept else None
        data["attacks"]["generations"]["methods"] = [
            m for m in point.attacks.generations.methods if m in sweep.methods
        ]
    if sweep.attacks is not None:
        for c in data["corpora"]:
            current = CorpusConfig.model_validate(c).resolved_attacks
            c["attacks"] = [a for a in current if a in sweep.attacks]
        if "bounds" not in sweep.attacks:
            data["bounds"]["enabled"] = False
    return validate_config(data)


def _base_stage(cfg: ExperimentConfig) -> Stage | None:
    if cfg.base != "tiny":
        return None
    return Stage(name="base/tiny", kind="train", inputs={"seed": cfg.seed}, run=run_tiny_base)


def _plan_point(cfg: ExperimentConfig, base_stage: Stage | None) -> list[Stage]:
    stages: list[Stage] = []
    if base_stage is not None:
        stages.append(base_stage)
    base_deps = {"base": base_stage} if base_stage is not None else {}
    adapters = cfg.train.lora and not cfg.train.merge_lora  # the bundle's constituents
    dtype_in = decode_dtype_input(cfg.precision, cfg.device, lora=adapters, base=cfg.base)
    for corpus in cfg.corpora:
        cs = _plan_corpus(cfg, corpus, base_deps)
        stages += [cs.partitions, *cs.constituents]
        stages += [s for s in (cs.reference, cs.goldfish) if s is not None]
        stages += [*cs.dp_constituents, *cs.dp.values()]
        stages += [s for s in (cs.bundle, cs.ref_bundle) if s is not None]
        stages += _plan_attacks(cfg, cs, dtype_in)
        if cfg.bounds.enabled and len(cfg.bound_methods) > 0:
            deps = {"bundle": cs.bundle, "partitions": cs.partitions}
            if cs.ref_bundle is not None and cfg.bounds.v_x:
                deps["ref_bundle"] = cs.ref_bundle
            stages.append(
                Stage(
                    name=f"bounds/{corpus.name}",
                    kind="bounds",
                    inputs={
                        "bounds": cfg.bounds.model_dump(),
                        "methods": cfg.bound_methods,
                        "m": cfg.m,
                        "corpus": corpus.name,
                        "batch_size": cfg.attacks.batch_size,
                        "seed": cfg.seed,
                        **dtype_in,
                    },
                    run=run_bounds,
                    deps=deps,
                )
            )
    return stages


def _plan_corpus(
    cfg: ExperimentConfig, corpus: CorpusConfig, base_deps: dict[str, Stage]
) -> _CorpusStages:
    partitions = Stage(
        name=f"partitions/{corpus.name}",
        kind="partitions",
        inputs={
            **_stage_inputs_corpus(cfg, corpus),
            "partitions": cfg.partitions.model_dump(),
            "holdout": cfg.references.holdout,
        },
        run=run_partitions,
    )
    train_in = _train_inputs(cfg)
    constituents = [
        Stage(
            name=f"train/{corpus.name}/c{i}",
            kind="train",
            inputs={**train_in, "partition": i, "role": "constituent"},
            run=run_train,
            deps={"partitions": partitions, **base_deps},
        )
        for i in range(cfg.partitions.k)
    ]
    bundle = Stage(
        name=f"bundle/{corpus.name}",
        kind="bundle",
        inputs={"base": cfg.base, "n_constant_prompts": 100},
        run=run_bundle,
        deps={
            "partitions": partitions,
            **{f"c{i}": s for i, s in enumerate(constituents)},
            **base_deps,
        },
    )
    cs = _CorpusStages(corpus, partitions, constituents, bundle)
    if cfg.needs_reference:
        cs.reference = Stage(
            name=f"train/{corpus.name}/ref",
            kind="train",
            inputs={**train_in, "partition": 0, "role": "reference"},
            run=run_train,
            deps={"partitions": partitions, **base_deps},
        )
        cs.ref_bundle = Stage(
            name=f"bundle/{corpus.name}/ref",
            kind="bundle",
            inputs={"base": cfg.base, "reference": True},
            run=run_ref_bundle,
            deps={
                "main": bundle,
                "c0": cs.reference,
                **{f"c{i}": s for i, s in enumerate(constituents) if i > 0},
            },
        )
    if cfg.baselines.goldfish is not None:
        cs.goldfish = Stage(
            name=f"train/{corpus.name}/{GOLDFISH}",
            kind="train",
            inputs={
                **train_in,
                "partition": 0,
                "role": GOLDFISH,
                GOLDFISH: cfg.baselines.goldfish.model_dump(),
            },
            run=run_train,
            deps={"partitions": partitions, **base_deps},
        )
    if cfg.baselines.dp is not None:
        _plan_dp(cfg, cs, train_in, base_deps)
    return cs


def _plan_dp(
    cfg: ExperimentConfig, cs: _CorpusStages, train_in: dict[str, Any], base_deps: dict[str, Stage]
) -> None:
    """The DP rows' stages (``baselines.dp``): a "single" row's one model on every partition
    together (``partition`` None), a "retrained" row's K constituents (each on its partition)
    and their bundle, named after the row."""
    dp = cfg.baselines.dp
    assert dp is not None
    name, parts = cs.corpus.name, cs.partitions
    for method in dp.methods:
        fields = {"role": "dp", "dp": dp.train_fields(method)}
        if M.SPECS[method].kind == "single":
            cs.dp[method] = Stage(
                name=f"train/{name}/{method}",
                kind="train",
                inputs={**train_in, "partition": None, **fields},
                run=run_train,
                deps={"partitions": parts, **base_deps},
            )
            continue
        cons = [
            Stage(
                name=f"train/{name}/{method}/c{i}",
                kind="train",
                inputs={**train_in, "partition": i, **fields},
                run=run_train,
                deps={"partitions": parts, **base_deps},
            )
            for i in range(cfg.partitions.k)
        ]
        cs.dp_constituents += cons
        cs.dp[method] = Stage(
            name=f"bundle/{name}/{method}",
            kind="bundle",
            inputs={"base": cfg.base, "n_constant_prompts": 100, "role": method},
            run=run_bundle,
            deps={"partitions": parts, **{f"c{i}": s for i, s in enumerate(cons)}, **base_deps},
        )


def _plan_attacks(
    cfg: ExperimentConfig, cs: _CorpusStages, dtype_in: dict[str, str]
) -> list[Stage]:
    corpus = cs.corpus
    out: list[Stage] = []
    attacks = corpus.resolved_attacks
    for method in cfg.all_methods:
        for attack in attacks:
            if attack == "generations" and method not in cfg.attacks.generations.methods:
                continue
            only = cfg.attacks.budget.methods
            if attack == "budget" and only is not None and method not in only:
                continue
            section = getattr(cfg.attacks, attack).model_dump()
            inputs: dict[str, Any] = {
                "method": method,
                "attack": attack,
                "config": section,
                "corpus": corpus.name,
                "batch_size": cfg.attacks.batch_size,
                "seed": cfg.seed,
            }
            if M.SPECS[method].smoothed:
                inputs["m"] = cfg.m
            if attack in ("mia", "budget") and cs.ref_bundle is not None:
                inputs["holdout"] = cfg.references.holdout
            if attack == "budget":  # the sweep's members and non-members: the MIA suite's
                inputs["mia_population"] = cfg.attacks.mia.population
            inputs.update(dtype_in)
            deps: dict[str, Stage] = {"bundle": cs.bundle, "partitions": cs.partitions}
            # LiRA's reference: over p0
            if attack in ("mia", "budget") and cs.ref_bundle is not None:
                deps["ref_bundle"] = cs.ref_bundle
                if M.SPECS[method].rule == "none" and cs.reference is not None:  # No CP, baselines
                    deps["reference"] = cs.reference
            if method == GOLDFISH and cs.goldfish is not None:
                deps[GOLDFISH] = cs.goldfish
            if method in cs.dp and M.SPECS[method].kind == "single":
                deps[method] = cs.dp[method]  # its one model, evaluated as a single
            elif method in cs.dp:
                deps["bundle"] = cs.dp[method]  # its rule over its own (DP) constituents
            out.append(
                Stage(
                    name=f"attack/{corpus.name}/{method}/{attack}",
                    kind="attack",
                    inputs=inputs,
                    run=run_budget if attack == "budget" else run_attack,
                    deps=deps,
                )
            )
    return out


def matches_stage(stage: Stage, pattern: str) -> bool:
    """``--force`` matching on the stage's name or its label (``"attack/*[m=100]"``): equal, a
    glob match, or a prefix up to a ``/`` (``"train"`` matches ``"train/ids/c0"``)."""
    return _matches(stage.name, pattern) or _matches(stage.label, pattern)


def _matches(name: str, pattern: str) -> bool:
    return (
        name == pattern
        or fnmatch.fnmatch(name, pattern)
        or name.startswith(pattern.rstrip("/") + "/")
    )


def topological(stages: Sequence[Stage]) -> list[Stage]:
    """``stages`` and their dependencies, each once (by key), every stage after its dependencies
    (depth first, in the given order)."""
    seen: dict[str, Stage] = {}
    order: list[Stage] = []

    def visit(s: Stage, stack: tuple[str, ...]) -> None:
        if s.key in seen:
            return
        if s.key in stack:
            raise ScpdrError(f"stage cycle through {s.name}")
        for d in s.deps.values():
            visit(d, (*stack, s.key))
        seen[s.key] = s
        order.append(s)

    for s in stages:
        visit(s, ())
    return order


class StageGraph:
    """The stages to run, each once, in :func:`topological` order."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.order = topological(stages)

    def __len__(self) -> int:
        return len(self.order)

    def ready(self, done: Mapping[str, Any]) -> list[Stage]:
        """The stages not in ``done`` (keys) whose dependencies all are, in graph order."""
        return [
            s
            for s in self.order
            if s.key not in done and all(d.key in done for d in s.deps.values())
        ]
