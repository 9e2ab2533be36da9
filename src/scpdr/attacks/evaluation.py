"""The one evaluation pipeline: scorers from a bundle → attacks → result rows.

``scpdr eval`` and every attack stage of ``scpdr experiment`` call these functions, so the same
bundle, data and options give the same rows (``tests/test_experiment.py`` checks it):

- :func:`load_scorers`: a :class:`BundleScorers` — one ``ProtectedLM`` per result-row method
  (:mod:`scpdr.methods`), built lazily over one copy of each model (a :class:`ModelStore`, which
  an experiment shares across its stages), plus LiRA's reference scorers, the base model (the
  ``ref`` attack's reference) and TTE's ``q``.
- :func:`run_eval`: every attack on every scorer, with wall-clock timings. The No CP scorer
  (``"none"``) also yields the No CP-val rows (paper Table 3: the same attacks on data the model
  never saw — validation names, never-inserted canaries, validation texts for TTE; for the MIA
  suite, null examples no model saw attacked as if they were members).

The secrets attack also measures each secret's chance level: the same query to the constituent(s)
that never saw the record (``counterfactual``; a bundle's :meth:`BundleScorers.unseen`), once,
attached to every method's :class:`~scpdr.attacks.secrets.SecretsResult` so that its rows carry
the paired tests against it.

Every attack reads the model under the TDE game's protocol (Def. 4.2, ``docs/attacks.md``): each
prefix a fresh request, a canary's secret the continuation of its prefix
(:func:`scpdr.attacks.scorer.score_requests`).
- :func:`generations`: greedy continuations of training prompts, side by side in the report.

The data is an :class:`~scpdr.attacks.eval_data.EvalData`; every attack draws its examples with
:func:`~scpdr.attacks.eval_data.select`, sized by :class:`EvalOptions`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from scpdr.attacks.bundle_scorers import (
    BUNDLE_METHODS,
    BundleScorers,
    ModelStore,
    bundle_bases,
    bundle_data_dir,
    load_scorers,
    smoothing_method,
)
from scpdr.attacks.eval_data import EvalData, MIAPopulation, select
from scpdr.attacks.exposure import canary_exposure
from scpdr.attacks.lira import LiRAResult
from scpdr.attacks.mia import DEFAULT_K, MIAResult, membership_inference
from scpdr.attacks.pii import pii_extraction
from scpdr.attacks.results import NO_CP_VAL, ResultRow
from scpdr.attacks.risk import record_ref_scores
from scpdr.attacks.scorer import Scorer, scorer_name
from scpdr.attacks.secrets import SecretsResult, counterfactual_extraction, secret_extraction
from scpdr.attacks.tte import token_by_token_extraction
from scpdr.attacks.utility import utility
from scpdr.errors import ConfigError

__all__ = [
    "ATTACKS",
    "BUNDLE_METHODS",
    "BundleScorers",
    "EvalData",
    "EvalOptions",
    "EvalReport",
    "ModelStore",
    "bundle_bases",
    "bundle_data_dir",
    "check_attacks",
    "generations",
    "load_scorers",
    "missing_data",
    "run_eval",
    "select",
    "smoothing_method",
]

log = logging.getLogger(__name__)

#: The attacks of the pipeline (each yields result rows). "mia" is the membership-inference suite
#: (rows of attacks loss, zlib, min-k, min-k++, ref, lira: :data:`scpdr.attacks.mia.MIA_ATTACKS`).
ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "mia", "utility", "secrets")
#: Other names the pipeline accepts: "lira" runs the suite (LiRA is one of its attacks).
ATTACK_ALIASES: dict[str, str] = {"lira": "mia"}

# ------------------------------------------------------------------------------------ options


@dataclass
class EvalOptions:
    """Sizes and knobs of :func:`run_eval` (``None`` = all examples / whole sequences).

    ``*_n`` are example counts drawn by :func:`select` (seeded by ``seed``); the MIA suite draws
    ``mia_n`` members and as many non-members from ``mia_population`` (``lira_n`` /
    ``lira_max_tokens``: older names of ``mia_n`` / ``mia_max_tokens``, used when those are
    unset). ``*_max_tokens`` truncate each example. ``seed`` also seeds the canary exposure's
    reference sample and every bootstrap. ``secrets_counterfactual``: measure each secret's
    chance level under the constituents that never saw its record (when they are known)."""

    n_reference: int = 10_000
    enumerate_limit: int = 1 << 14
    batch_size: int = 16
    pii_n: int | None = None
    pii_val_n: int | None = None
    tte_n: int | None = 64
    tte_max_tokens: int | None = 256
    tte_q_fails: bool = False
    lira_n: int | None = None
    lira_max_tokens: int | None = 256
    mia_n: int | None = None
    mia_max_tokens: int | None = None
    mia_population: str = "auto"
    mia_k: float = DEFAULT_K
    utility_n: int | None = None
    utility_max_tokens: int | None = 256
    secrets_n: int | None = None
    secrets_val_n: int | None = None
    secrets_counterfactual: bool = True
    seed: int = 0


@dataclass
class EvalReport:
    """Rows, wall-clock timings per (method, attack), the MIA suite's results per method and
    their LiRA part (for ROC curves)."""

    rows: list[ResultRow] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    lira: dict[str, LiRAResult] = field(default_factory=dict)
    mia: dict[str, MIAResult] = field(default_factory=dict)
    secrets: dict[str, SecretsResult] = field(default_factory=dict)

    def roc_curves(self) -> dict[str, dict[str, Any]]:
        """``{method: {"fpr", "tpr", "auc"}}`` (``scpdr.report.ReportInputs.roc`` for one corpus)."""
        out = {}
        for m, res in self.lira.items():
            fpr, tpr = res.roc()
            out[m] = {"fpr": fpr.tolist(), "tpr": tpr.tolist(), "auc": res.auc}
        return out


def check_attacks(attacks: Sequence[str]) -> list[str]:
    """``attacks`` with aliases resolved (:data:`ATTACK_ALIASES`), each once; raise
    :class:`ConfigError` naming any that is not in :data:`ATTACKS`."""
    bad = [a for a in attacks if a not in ATTACKS and a not in ATTACK_ALIASES]
    if bad:
        known = ", ".join([*ATTACKS, *ATTACK_ALIASES])
        raise ConfigError(f"unknown attack(s) {bad}; known: {known}")
    return list(dict.fromkeys(ATTACK_ALIASES.get(a, a) for a in attacks))


def _population(data: EvalData, opts: EvalOptions) -> MIAPopulation | None:
    n = opts.mia_n if opts.mia_n is not None else opts.lira_n
    return data.mia_population(opts.mia_population, n, seed=opts.seed)


def _examples(data: EvalData, opts: EvalOptions) -> dict[str, tuple[list[Any], Any, str]]:
    """attack -> (examples, No CP-val examples or None, what is missing when there are none);
    the MIA suite's are its :class:`MIAPopulation` (twice)."""
    seed = opts.seed
    pop = _population(data, opts)
    return {
        "canary": (
            list(data.canaries) if data.canary_space is not None else [],
            None,
            "no canaries in the data",
        ),
        "pii": (
            select(data.pii, opts.pii_n, seed=seed, salt="pii"),
            select(data.pii_val, opts.pii_val_n, seed=seed, salt="pii-val"),
            "no Names2IDs records in the data",
        ),
        "tte": (
            select(data.train, opts.tte_n, seed=seed, salt="tte"),
            select(data.validation, opts.tte_n, seed=seed, salt="tte-val"),
            "no training texts",
        ),
        "mia": (
            [pop] if pop is not None else [],
            pop,
            f"no members or no non-members ({opts.mia_population} population)",
        ),
        "utility": (
            select(data.validation, opts.utility_n, seed=seed, salt="utility"),
            None,
            "no validation texts",
        ),
        "secrets": (
            select(data.secrets, opts.secrets_n, seed=seed, salt="secrets"),
            select(data.secrets_val, opts.secrets_val_n, seed=seed, salt="secrets-val"),
            "no declared secrets in the data (--secrets-field, --secret-pattern)",
        ),
    }


def missing_data(
    data: EvalData, attacks: Sequence[str], options: EvalOptions | None = None
) -> dict[str, str]:
    """``{attack: what is missing}`` for each of ``attacks`` that ``data`` gives nothing to
    attack (:func:`run_eval` skips it). Check it before loading models: when it names every
    requested attack, an evaluation would produce no rows."""
    ex = _examples(data, options or EvalOptions())
    out = {}
    for attack in attacks:
        examples, _, missing = ex[ATTACK_ALIASES.get(attack, attack)]
        if not examples:
            out[attack] = missing
    return out


# ------------------------------------------------------------------------------------ attacks


def _canary_rows(res: Any, method: str, corpus: str | None) -> list[ResultRow]:
    """Exposure rows of ``method``; the never-inserted canaries' rows (the random-canary
    baseline) are No CP-val's canary rows under No CP, with ``repetitions`` 0 so that the
    canary table's baseline row and the main table find them, and are dropped under every other
    method (each inserted row keeps its own ``baseline_value`` and 2-std flag)."""
    out = []
    for r in res.rows(method=method, corpus=corpus):
        if not r.extra.get("baseline"):
            out.append(r)
        elif method == "none":
            extra = {**r.extra, "repetitions": 0}
            metric = r.metric.removeprefix("baseline_")
            out.append(ResultRow(NO_CP_VAL, r.attack, metric, r.value, r.n, r.std, r.corpus, extra))
    return out


def run_eval(
    scorers: Mapping[str, Scorer],
    data: EvalData,
    attacks: Sequence[str],
    *,
    options: EvalOptions | None = None,
    reference: Callable[[str], Scorer | None] | Mapping[str, Scorer] | None = None,
    q_scorer: Scorer | None = None,
    base: Scorer | None = None,
    counterfactual: Callable[[int | None], Sequence[Scorer]] | Sequence[Scorer] | None = None,
) -> EvalReport:
    """Run ``attacks`` (names of :data:`ATTACKS`) on every scorer; rows are named by the keys of
    ``scorers``. ``reference(method)`` (or a mapping) gives LiRA's reference scorer for a method
    (trained without the members); ``base`` is the ``ref`` attack's reference (the base model);
    ``q_scorer`` enables TTE's "q fails" rows; ``base`` also gives the secrets attack each
    record's ``ref`` score. ``counterfactual(partition)`` (or one list for every partition)
    gives the models that never saw a secret's record (the secrets attack's per-record chance
    level, :func:`~scpdr.attacks.secrets.counterfactual_extraction`). For a
    :class:`BundleScorers` all four default to its own (:meth:`BundleScorers.reference_of`,
    ``base``, ``q``, :meth:`BundleScorers.unseen`). An attack without its data
    (:func:`missing_data`) is skipped with a log line."""
    opts = options or EvalOptions()
    attacks = check_attacks(attacks)
    if isinstance(scorers, BundleScorers):
        reference = reference if reference is not None else scorers.reference_of
        base = base if base is not None else scorers.base
        q_scorer = q_scorer if q_scorer is not None else (scorers.q if opts.tte_q_fails else None)
        counterfactual = counterfactual if counterfactual is not None else scorers.unseen
    if not opts.secrets_counterfactual:
        counterfactual = None
    ref_of: Callable[[str], Scorer | None]
    if reference is None:
        ref_of = lambda _m: None  # noqa: E731
    elif isinstance(reference, Mapping):
        ref_of = reference.get
    else:
        ref_of = reference
    rep = EvalReport()
    corpus = data.corpus
    ref_cache: dict = {}  # base / reference scores, shared by the methods that share them

    def timed(method: str, attack: str, n: int, fn: Callable[[], list[ResultRow]]) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        rows = fn()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rep.rows.extend(rows)
        rep.timings.append(
            {
                "method": method,
                "attack": attack,
                "seconds": dt,
                "cpu_seconds": cpu,  # all threads of this process: robust on a shared machine
                "examples": n,
                "seconds_per_100": 100.0 * dt / n if n else None,
            }
        )
        log.info("%s / %s: %d examples in %.1f s", method, attack, n, dt)

    def canary_rows(scorer: Scorer, canaries: list[Any], name: str) -> list[ResultRow]:
        res = canary_exposure(
            scorer,
            canaries,
            data.canary_space,
            n_reference=opts.n_reference,
            enumerate_limit=opts.enumerate_limit,
            batch_size=opts.batch_size,
            seed=opts.seed,
        )
        return _canary_rows(res, name, corpus)

    def pii_rows(scorer: Scorer, recs: list[Any], name: str) -> list[ResultRow]:
        res = pii_extraction(scorer, recs, batch_size=opts.batch_size)
        return res.rows(method=name, corpus=corpus)

    def tte_rows(scorer: Scorer, ex: list[Any], name: str) -> list[ResultRow]:
        res = token_by_token_extraction(
            scorer,
            ex,
            q_scorer=q_scorer if opts.tte_q_fails else None,
            max_tokens=opts.tte_max_tokens,
            batch_size=opts.batch_size,
        )
        return res.rows(method=name, corpus=corpus)

    def mia_rows(
        scorer: Scorer, pop: MIAPopulation, name: str, ref: Scorer | None, b: Scorer | None
    ) -> list[ResultRow]:
        res = membership_inference(
            scorer,
            pop.members,
            pop.nonmembers,
            base=b,
            reference=ref,
            lira_members=pop.lira_members,
            population=pop.name,
            method=name,
            k=opts.mia_k,
            max_tokens=opts.mia_max_tokens or opts.lira_max_tokens,
            batch_size=opts.batch_size,
            cache=ref_cache,
        )
        rep.mia[name] = res
        mem, non = res.scores.members.get("lira"), res.scores.nonmembers.get("lira")
        if mem and non:  # LiRA alone, for `scpdr eval`'s ROC plot
            labels = np.r_[np.ones(len(mem), bool), np.zeros(len(non), bool)]
            rep.lira[name] = LiRAResult(np.r_[mem, non], labels, name, scorer_name(ref))
        return res.rows(method=name, corpus=corpus, seed=opts.seed)

    def utility_rows(scorer: Scorer, val: list[Any], name: str) -> list[ResultRow]:
        res = utility(scorer, val, max_tokens=opts.utility_max_tokens, batch_size=opts.batch_size)
        return res.rows(method=name, corpus=corpus)

    chance: list[SecretsResult | None] = []  # the counterfactual, measured once

    def secrets_chance(targets: list[Any]) -> SecretsResult | None:
        if not chance and counterfactual is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                cf = counterfactual_extraction(counterfactual, targets, batch_size=opts.batch_size)
            except ValueError as e:  # no model without the records (one constituent)
                log.warning("secrets: no per-record chance level: %s", e)
                cf = None
            chance.append(cf)
            n, dt = len(targets), time.perf_counter() - t0
            rep.timings.append(
                {
                    "method": "counterfactual",
                    "attack": "secrets",
                    "seconds": dt,
                    "cpu_seconds": time.process_time() - c0,
                    "examples": n,
                    "seconds_per_100": 100.0 * dt / n if n else None,
                }
            )
        return chance[0] if chance else None

    def secrets_rows(scorer: Scorer, targets: list[Any], name: str) -> list[ResultRow]:
        res = secret_extraction(scorer, targets, batch_size=opts.batch_size)
        if name != NO_CP_VAL:  # the per-record risk report (attacks/risk.py)
            res.counterfactual = secrets_chance(targets)
            if base is not None:
                texts = {t.record: t.text for t in targets}
                res.ref = record_ref_scores(
                    scorer,
                    base,
                    texts,
                    batch_size=opts.batch_size,
                    max_tokens=opts.lira_max_tokens,
                    cache=ref_cache,
                )
            rep.secrets[name] = res
        return res.rows(method=name, corpus=corpus, seed=opts.seed)

    examples_of = _examples(data, opts)
    rows_of = {
        "canary": canary_rows,
        "pii": pii_rows,
        "tte": tte_rows,
        "utility": utility_rows,
        "secrets": secrets_rows,
    }

    for method, scorer in scorers.items():
        for attack in attacks:
            if attack in rows_of:
                examples, none_val, missing = examples_of[attack]
                if not examples:
                    log.info("%s: %s, skipped", attack, missing)
                    continue
                fn = rows_of[attack]
                if attack == "secrets":
                    secrets_chance(examples)  # once, timed on its own
                timed(method, attack, len(examples), partial(fn, scorer, examples, method))
                if method == "none" and none_val:  # No CP on examples no constituent saw
                    timed(
                        NO_CP_VAL, attack, len(none_val), partial(fn, scorer, none_val, NO_CP_VAL)
                    )
            elif attack == "mia":
                pop = examples_of["mia"][1]
                if pop is None:
                    log.info("mia: %s, skipped", examples_of["mia"][2])
                    continue
                n = len(pop.members) + len(pop.nonmembers)
                mia_fn = partial(mia_rows, scorer, pop, method, ref_of(method), base)
                timed(method, "mia", n, mia_fn)
                if method == "none" and pop.null:  # No CP on examples no model saw
                    null = MIAPopulation(pop.null, pop.nonmembers, None, [], pop.name)
                    null_fn = partial(mia_rows, scorer, null, NO_CP_VAL, ref_of(method), base)
                    timed(NO_CP_VAL, "mia", len(pop.null) + len(pop.nonmembers), null_fn)
    return rep


def generations(
    scorer: Scorer, data: EvalData, *, n: int, max_new_tokens: int, seed: int = 0
) -> list[dict[str, str]]:
    """Greedy continuations of ``n`` training prompts (``select``-ed from ``data.records``;
    text-only records: the first half of the text is the prompt), each with the training text's
    continuation as ``reference``."""
    records = [r for r in data.records if r.prompt] or list(data.records)
    chosen = select(records, n, seed=seed, salt="generations")
    prompts, refs = [], []
    for r in chosen:
        if r.prompt:
            prompts.append(r.prompt)
            refs.append(r.response or "")
        else:
            cut = max(1, len(r.text) // 2)
            prompts.append(r.text[:cut])
            refs.append(r.text[cut:])
    gens = scorer.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
    return [
        {"prompt": p, "reference": ref, "text": g.text}
        for p, ref, g in zip(prompts, refs, gens, strict=True)
    ]
