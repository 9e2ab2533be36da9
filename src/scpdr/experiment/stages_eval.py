"""The stage bodies that evaluate an experiment's bundles: one attack stage per corpus × method ×
attack (through the one evaluation pipeline, :mod:`scpdr.attacks.evaluation`, exactly as
``scpdr eval`` runs it), the bound distributions per corpus, and the report over every result.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.errors import ConfigError
from scpdr.experiment.cache import StageContext
from scpdr.experiment.sections import BoundsConfig
from scpdr.experiment.stages import TARGETS_NAME, baseline_singles, load_pset
from scpdr.io import atomic_write_json, read_json

if TYPE_CHECKING:  # pragma: no cover - the pipeline imports torch: loaded when a stage runs
    from scpdr.attacks.evaluation import EvalOptions, ModelStore

__all__ = [
    "DISTRIBUTIONS_NAME",
    "ROWS_NAME",
    "attack_options",
    "model_store",
    "run_attack",
    "run_bounds",
    "run_report",
    "stage_dtype",
]

ROWS_NAME = "rows.json"
DISTRIBUTIONS_NAME = "distributions.npz"
MODEL_CACHE_SIZE = 6
"""Models an executor process keeps loaded across stages (a corpus's constituents, base, p0)."""


def model_store(ctx: StageContext) -> ModelStore:
    """The model store the stages of this process share (stages of one corpus share models)."""
    from scpdr.attacks.evaluation import ModelStore

    store = ctx.memo.get("models")
    if store is None:
        store = ctx.memo["models"] = ModelStore(capacity=MODEL_CACHE_SIZE)
    return store


def stage_dtype(ctx: StageContext) -> Any:
    """The dtype the stage loads its models in: its ``dtype`` input (the experiment's
    ``precision`` where it differs from the device's default: ``plan.decode_dtype_input``), else
    None (the device's default)."""
    import torch

    name = ctx.stage.inputs.get("dtype")
    return None if name is None else getattr(torch, name)


def attack_options(
    attack: str, section: dict[str, Any], *, batch_size: int, seed: int
) -> EvalOptions:
    """The :class:`EvalOptions` of one attack stage: its config section (``attacks.<attack>``)
    mapped onto the pipeline's options; examples are never truncated (no ``max_tokens``)."""
    from scpdr.attacks.evaluation import EvalOptions

    opts = EvalOptions(
        batch_size=batch_size,
        seed=seed,
        tte_max_tokens=None,
        lira_max_tokens=None,
        utility_max_tokens=None,
    )
    if attack == "canary":
        opts.n_reference = int(section["n_reference"])
    elif attack == "pii":
        opts.pii_n, opts.pii_val_n = section["n"], section["n_val"]
    elif attack == "tte":
        opts.tte_n, opts.tte_q_fails = section["n"], bool(section["q_fails_only"])
    elif attack == "mia":
        opts.mia_n, opts.mia_population, opts.mia_k = (
            section["n"],
            section["population"],
            section["k"],
        )
    elif attack == "utility":
        opts.utility_n = section["n"]
    return opts


def run_attack(ctx: StageContext) -> None:
    """One attack on one method of one corpus: the data of partition 0 (the MIA suite's "records"
    members: the targets p0 was trained without; p0 saw no canary), the scorers of the corpus's
    bundle, :func:`run_eval`. Writes ``rows.json`` (and ``roc.json`` for the MIA
    suite: ``{attack: curve}`` per row name, ``generations.json`` for generations)."""
    import torch

    from scpdr.attacks.evaluation import (
        EvalData,
        generations,
        load_scorers,
        missing_data,
        run_eval,
    )

    inp = ctx.stage.inputs
    method, attack, corpus = inp["method"], inp["attack"], inp["corpus"]
    bundle_dir = ctx.dep("bundle") / "bundle"
    pset = load_pset(ctx.dep("partitions"))
    data = EvalData.from_partition_set(pset, target=0, corpus=corpus)
    reference = None
    if attack == "mia" and "ref_bundle" in ctx.deps:
        holdout = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
        # Records, not texts: a prompted example is scored on its response given its prompt
        # (the paper's r1(y|x) / r0(y|x); Names2IDs: the ID given "Name: <name>, ID:").
        # The "records" population: the held-out targets (p0 never saw them, so LiRA's
        # reference is valid for all) vs validation records; p0 never saw a canary either.
        data.members = [r for r in pset.parts[0] if r.id in holdout]
        reference = _reference_model(ctx.dep("ref_bundle") / "bundle")
    singles = baseline_singles(ctx)
    scorers = load_scorers(
        bundle_dir,
        [method],
        m=int(inp.get("m", ctx.config.m)),
        reference=reference,
        singles=singles,
        store=model_store(ctx),
        device=ctx.config.device,
        dtype=stage_dtype(ctx),
    )
    seed, bs = int(inp["seed"]), int(inp["batch_size"])
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        if attack == "generations":
            acfg = inp["config"]
            gens = generations(
                scorers[method],
                data,
                n=int(acfg["n"]),
                max_new_tokens=int(acfg["max_new_tokens"]),
                seed=seed,
            )
            atomic_write_json(ctx.dir / "generations.json", [g | {"method": method} for g in gens])
        else:
            opts = attack_options(attack, inp["config"], batch_size=bs, seed=seed)
            missing = missing_data(data, [attack], opts)
            if missing:
                raise ConfigError(f"corpora.{corpus}: attack {attack!r}: {missing[attack]}")
            report = run_eval(scorers, data, [attack], options=opts)
            rows = [r.to_dict() for r in report.rows]
            if report.mia:
                curves = {name: res.curves() for name, res in report.mia.items()}
                atomic_write_json(ctx.dir / "roc.json", curves)
    atomic_write_json(ctx.dir / ROWS_NAME, rows)


def _reference_model(ref_bundle: Path) -> str:
    """p0: constituent 0 of the reference bundle (trained on partition 0 without the targets)."""
    from scpdr.models import read_bundle

    manifest = read_bundle(ref_bundle)
    return manifest.resolve(ref_bundle, manifest.constituents[0])


def run_bounds(ctx: StageContext) -> None:
    """Per-position k_x / t_x (typical tokens: partition-0 training text), v_x(y_s) (the held-out
    targets of the reference p0) and all three on the canaries' secret tokens (rare tokens),
    for every NAF method (``scpdr.attacks.bounds_analysis``)."""
    import numpy as np
    import torch

    from scpdr.attacks.bounds_analysis import bound_distributions
    from scpdr.attacks.evaluation import EvalData, load_scorers, select, smoothing_method
    from scpdr.attacks.scorer import encode
    from scpdr.models import load_constant_base, read_bundle

    inp = ctx.stage.inputs
    bcfg = BoundsConfig.model_validate(inp["bounds"])
    bundle_dir = ctx.dep("bundle") / "bundle"
    pset = load_pset(ctx.dep("partitions"))
    corpus, seed, m = inp["corpus"], int(inp["seed"]), int(inp["m"])
    methods = list(inp["methods"])
    bs = max(1, min(int(inp["batch_size"]), 4))
    # one scorer whose components carry the constituents' and the base model's log-probs
    through = smoothing_method("model")
    dev, dtype = ctx.config.device, stage_dtype(ctx)
    scorers = load_scorers(
        bundle_dir, [through], m=m, store=model_store(ctx), device=dev, dtype=dtype
    )
    scorer = scorers[through]
    base_vector = load_constant_base(bundle_dir, read_bundle(bundle_dir))
    ref = None
    if "ref_bundle" in ctx.deps:  # its components[0] is p0
        ref_dir = ctx.dep("ref_bundle") / "bundle"
        ref = load_scorers(
            ref_dir, ["cp-delta"], m=m, store=model_store(ctx), device=dev, dtype=dtype
        )["cp-delta"]
    tx = ["t_x"] if bcfg.t_x else []
    common = {"methods": methods, "m": m, "base_vector": base_vector, "batch_size": bs}
    rows: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}

    def keep(dist: Any, *, rare: bool) -> None:
        rows.extend(r.to_dict() | {"corpus": corpus} for r in dist.rows(corpus=corpus, rare=rare))
        for q, per in dist.as_report_distributions(rare=rare).items():
            for method, vals in per.items():
                key = f"{q}/{method}"
                prev = arrays.get(key)
                new = np.asarray(vals, dtype=np.float64)
                arrays[key] = new if prev is None else np.concatenate([prev, new])

    data = EvalData.from_partition_set(pset, target=0, corpus=corpus)
    with torch.inference_mode():
        texts = select(data.train, bcfg.n_prompts, seed=seed, salt="bounds")
        keep(bound_distributions(scorer, texts, quantities=["k_x", *tx], **common), rare=False)
        if bcfg.v_x and ref is not None:
            holdout = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
            targets = [r.text for r in pset.parts[0] if r.id in holdout]
            if targets:
                dist = bound_distributions(
                    scorer, targets, quantities=["v_x"], ref_scorer=ref, **common
                )
                keep(dist, rare=False)
        if pset.canaries is not None and pset.canaries.inserted:
            tok = scorer.tokenizer
            canaries = list(pset.canaries.inserted)
            starts = [len(encode(tok, c.prompt)) for c in canaries]
            quantities = ["k_x", *tx, *(["v_x"] if bcfg.v_x and ref is not None else [])]
            dist = bound_distributions(
                scorer,
                [c.text for c in canaries],
                quantities=quantities,
                ref_scorer=ref if "v_x" in quantities else None,
                start=starts,
                **common,
            )
            keep(dist, rare=True)
    np.savez_compressed(ctx.dir / DISTRIBUTIONS_NAME, **arrays)
    atomic_write_json(ctx.dir / ROWS_NAME, rows)


def run_report(ctx: StageContext) -> None:
    import numpy as np

    from scpdr.report import ReportInputs, render_report

    inp = ctx.stage.inputs
    tags: dict[str, dict[str, Any]] = inp["tags"]
    rows: list[dict[str, Any]] = []
    distributions: dict[str, dict[str, dict[str, Any]]] = {}
    roc: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    generations: dict[tuple[str, str], dict[str, Any]] = {}
    for role, path in ctx.deps.items():
        tag = tags.get(role, {})
        name = role.split(":", 1)[1] if tag else role
        stage_rows = read_json(path / ROWS_NAME) if (path / ROWS_NAME).exists() else []
        rows += [{**r, **tag} for r in stage_rows]
        if tag:
            continue  # figures and generations come from the main run
        parts = name.split("/")
        if parts[0] == "bounds" and (path / DISTRIBUTIONS_NAME).exists():
            with np.load(path / DISTRIBUTIONS_NAME) as npz:
                for key in npz.files:
                    quantity, method = key.split("/", 1)
                    distributions.setdefault(parts[1], {}).setdefault(quantity, {})[method] = npz[
                        key
                    ]
        if parts[0] == "attack" and parts[3] == "mia" and (path / "roc.json").exists():
            for method, curves in read_json(path / "roc.json").items():
                for attack, curve in curves.items():
                    roc.setdefault(parts[1], {}).setdefault(attack, {})[method] = curve
        if parts[0] == "attack" and parts[3] == "generations":
            for i, g in enumerate(read_json(path / "generations.json")):
                entry = generations.setdefault(
                    (parts[1], f"{i:04d}"),
                    {
                        "corpus": parts[1],
                        "prompt": g["prompt"],
                        "reference": g["reference"],
                        "outputs": {},
                    },
                )
                entry["outputs"][parts[2]] = g["text"]
    atomic_write_json(ctx.dir / "results.json", rows)
    render_report(
        ReportInputs(
            rows=rows,
            title=inp["title"],
            corpus_labels=inp["labels"],
            methods=inp["methods"],
            summary=inp["summary"],
            distributions=distributions,
            roc=roc,
            generations=[generations[k] for k in sorted(generations)],
            generation_methods=inp["generation_methods"],
            config_text=inp.get("config_text"),
        ),
        ctx.dir,
        draw=bool(inp["report"]["plots"]),
    )
