"""The stage body of the budget sweep (attack ``budget``, ``docs/accountant.md``): one stage per
corpus × method runs :func:`scpdr.attacks.budget.budget_sweep` over every budget of
``attacks.budget.budgets`` (each example one response held to B; the budgets are read off one
trace per method, so the sweep costs one unbudgeted pass).

Data as the other attack stages draw it: partition 0's PII records, the utility texts, and the
MIA suite's members and non-members (``attacks.mia.population``: the membership canaries inserted
once vs never inserted, or partition 0's held-out targets vs validation records; p0, LiRA's
reference, saw neither, :meth:`scpdr.attacks.eval_data.EvalData.mia_population`); the ``ref``
membership attack's reference is the bundle's base model, ``lira``'s the method's reference
(:meth:`scpdr.attacks.bundle_scorers.BundleScorers.reference_of`).
"""

from __future__ import annotations

from typing import Any

from scpdr.experiment.cache import StageContext
from scpdr.experiment.stages import TARGETS_NAME, baseline_singles, load_pset
from scpdr.experiment.stages_eval import model_store, stage_dtype
from scpdr.io import atomic_write_json, read_json

__all__ = ["BUDGET_ROWS_NAME", "run_budget"]

#: The rows file of an attack stage (the report stage reads it).
BUDGET_ROWS_NAME = "rows.json"


def run_budget(ctx: StageContext) -> None:
    """The budget sweep of one method on one corpus; writes ``rows.json``."""
    import torch

    from scpdr.attacks.budget import BudgetOptions, budget_sweep
    from scpdr.attacks.eval_data import EvalData, select
    from scpdr.attacks.evaluation import load_scorers
    from scpdr.models import read_bundle

    inp = ctx.stage.inputs
    method, corpus, cfg = inp["method"], inp["corpus"], inp["config"]
    seed, bs = int(inp["seed"]), int(inp["batch_size"])
    pset = load_pset(ctx.dep("partitions"))
    data = EvalData.from_partition_set(pset, target=0, corpus=corpus)
    reference = None
    if "ref_bundle" in ctx.deps:
        # the "records" population: the held-out targets p0 never saw (p0 saw no canary either)
        holdout = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
        data.members = [r for r in pset.parts[0] if r.id in holdout]
        ref_dir = ctx.dep("ref_bundle") / "bundle"
        ref_manifest = read_bundle(ref_dir)
        reference = ref_manifest.resolve(ref_dir, ref_manifest.constituents[0])
    pop = data.mia_population(inp.get("mia_population", "auto"), cfg.get("mia_n"), seed=seed)
    bundle_dir = ctx.dep("bundle") / "bundle"
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
    refs: dict[str, Any] = {"lira": scorers.reference_of(method)}
    if scorers.base is not None:  # the bundle's base alone, from the same store and dtype
        refs["ref"] = scorers.base
    options = BudgetOptions(
        budgets=tuple(None if b is None else float(b) for b in cfg["budgets"]),
        utility_n=None,  # drawn here, with the pipeline's subset rule
        answer_n=cfg["answer_n"],
        answer_prompt_tokens=int(cfg["answer_prompt_tokens"]),
        answer_tokens=int(cfg["answer_tokens"]),
        max_tokens=cfg.get("max_tokens"),
        batch_size=bs,
        seed=seed,
        modes=tuple(cfg.get("modes") or ("stop",)),
        anchors=tuple(float(c) for c in cfg.get("anchors") or ()),
    )
    with torch.inference_mode():
        rows = budget_sweep(
            scorers[method],
            method=method,
            pii=select(data.pii, cfg.get("pii_n"), seed=seed, salt="pii"),
            validation=select(data.validation, cfg.get("utility_n"), seed=seed, salt="utility"),
            members=pop.members if pop is not None else (),
            nonmembers=pop.nonmembers if pop is not None else (),
            references=refs,
            options=options,
            corpus=corpus,
        )
    atomic_write_json(ctx.dir / BUDGET_ROWS_NAME, [r.to_dict() for r in rows])
