"""The one evaluation pipeline: scorers from a bundle → attacks → result rows.

``scpdr eval`` and every attack stage of ``scpdr experiment`` call these functions, so the same
bundle, data and options give the same rows (``tests/test_experiment.py`` checks it):

- :func:`load_scorers`: a :class:`BundleScorers` — one ``ProtectedLM`` per result-row method
  (:mod:`scpdr.methods`), built lazily over one copy of each model (a :class:`ModelStore`, which
  an experiment shares across its stages), plus LiRA's reference scorers and TTE's ``q``.
- :func:`run_eval`: every attack on every scorer, with wall-clock timings. The No CP scorer
  (``"none"``) also yields the No CP-val rows (paper Table 3: the same attacks on data the model
  never saw — validation names, never-inserted canaries, validation texts for TTE).
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

from scpdr.attacks.bundle_scorers import (
    BUNDLE_METHODS,
    BundleScorers,
    ModelStore,
    bundle_bases,
    bundle_data_dir,
    load_scorers,
    smoothing_method,
)
from scpdr.attacks.eval_data import EvalData, select
from scpdr.attacks.exposure import canary_exposure
from scpdr.attacks.lira import LiRAResult, lira
from scpdr.attacks.pii import pii_extraction
from scpdr.attacks.results import NO_CP_VAL, ResultRow
from scpdr.attacks.risk import record_ref_scores
from scpdr.attacks.scorer import Scorer
from scpdr.attacks.secrets import SecretsResult, secret_extraction
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

#: The attacks of the pipeline (each yields result rows).
ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "lira", "utility", "secrets")

# ------------------------------------------------------------------------------------ options


@dataclass
class EvalOptions:
    """Sizes and knobs of :func:`run_eval` (``None`` = all examples / whole sequences).

    ``*_n`` are example counts drawn by :func:`select` (seeded by ``seed``); LiRA draws as many
    non-members as members. ``*_max_tokens`` truncate each example. ``seed`` also seeds the
    canary exposure's reference sample."""

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
    utility_n: int | None = None
    utility_max_tokens: int | None = 256
    secrets_n: int | None = None
    secrets_val_n: int | None = None
    seed: int = 0


@dataclass
class EvalReport:
    """Rows, wall-clock timings per (method, attack) and the LiRA results (for ROC curves)."""

    rows: list[ResultRow] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    lira: dict[str, LiRAResult] = field(default_factory=dict)
    secrets: dict[str, SecretsResult] = field(default_factory=dict)

    def roc_curves(self) -> dict[str, dict[str, Any]]:
        """``{method: {"fpr", "tpr", "auc"}}`` (``scpdr.report.ReportInputs.roc`` for one corpus)."""
        out = {}
        for m, res in self.lira.items():
            fpr, tpr = res.roc()
            out[m] = {"fpr": fpr.tolist(), "tpr": tpr.tolist(), "auc": res.auc}
        return out


def check_attacks(attacks: Sequence[str]) -> None:
    """Raise :class:`ConfigError` naming any of ``attacks`` that is not in :data:`ATTACKS`."""
    bad = [a for a in attacks if a not in ATTACKS]
    if bad:
        raise ConfigError(f"unknown attack(s) {bad}; known: {', '.join(ATTACKS)}")


def _examples(data: EvalData, opts: EvalOptions) -> dict[str, tuple[list[Any], Any, str]]:
    """attack -> (examples, No CP-val examples or None, what is missing when there are none);
    LiRA's second item is its non-members."""
    seed = opts.seed
    members = select(
        data.members if data.members is not None else data.train,
        opts.lira_n,
        seed=seed,
        salt="lira-members",
    )
    nonmembers = select(
        data.nonmembers if data.nonmembers is not None else data.validation,
        len(members),
        seed=seed,
        salt="lira-non",
    )
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
        "lira": (
            members,
            nonmembers,
            "no members or no non-members (training and validation examples)",
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
    check_attacks(attacks)
    ex = _examples(data, options or EvalOptions())
    out = {}
    for attack in attacks:
        examples, second, missing = ex[attack]
        if not examples or (attack == "lira" and not second):
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
    base_scorer: Scorer | None = None,
) -> EvalReport:
    """Run ``attacks`` (names of :data:`ATTACKS`) on every scorer; rows are named by the keys of
    ``scorers``. ``reference(method)`` (or a mapping) gives LiRA's reference scorer for a method
    (trained without the members); ``q_scorer`` enables TTE's "q fails" rows; ``base_scorer``
    (the base model alone) gives the secrets attack each record's ``ref`` score. For a
    :class:`BundleScorers` they default to its own (:meth:`BundleScorers.reference_of`, ``q``,
    ``base``).
    An attack without its data (:func:`missing_data`) is skipped with a log line."""
    opts = options or EvalOptions()
    check_attacks(attacks)
    if isinstance(scorers, BundleScorers):
        reference = reference if reference is not None else scorers.reference_of
        q_scorer = q_scorer if q_scorer is not None else (scorers.q if opts.tte_q_fails else None)
        if base_scorer is None and "secrets" in attacks:
            base_scorer = scorers.base
    ref_of: Callable[[str], Scorer | None]
    if reference is None:
        ref_of = lambda _m: None  # noqa: E731
    elif isinstance(reference, Mapping):
        ref_of = reference.get
    else:
        ref_of = reference
    rep = EvalReport()
    corpus = data.corpus
    lira_cache: dict = {}  # reference scores, shared by the methods that share a reference

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

    def utility_rows(scorer: Scorer, val: list[Any], name: str) -> list[ResultRow]:
        res = utility(scorer, val, max_tokens=opts.utility_max_tokens, batch_size=opts.batch_size)
        return res.rows(method=name, corpus=corpus)

    ref_cache: dict = {}  # the base model's log-probs, shared by the methods

    def secrets_rows(scorer: Scorer, targets: list[Any], name: str) -> list[ResultRow]:
        res = secret_extraction(scorer, targets, batch_size=opts.batch_size)
        if name != NO_CP_VAL:  # the per-record risk report (attacks/risk.py)
            if base_scorer is not None:
                texts = {t.record: t.text for t in targets}
                res.ref = record_ref_scores(
                    scorer,
                    base_scorer,
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
                timed(method, attack, len(examples), partial(fn, scorer, examples, method))
                if method == "none" and none_val:  # No CP on examples no constituent saw
                    timed(
                        NO_CP_VAL, attack, len(none_val), partial(fn, scorer, none_val, NO_CP_VAL)
                    )
            elif attack == "lira":
                members, non, _ = examples_of["lira"]
                ref = ref_of(method) if members and non else None
                if ref is None:
                    log.info(
                        "lira: %s skipped (members, non-members and a reference needed)", method
                    )
                    continue

                def run_lira(method=method, scorer=scorer, ref=ref, members=members, non=non):
                    res = lira(
                        scorer,
                        ref,
                        members,
                        non,
                        max_tokens=opts.lira_max_tokens,
                        batch_size=opts.batch_size,
                        cache=lira_cache,
                    )
                    rep.lira[method] = res
                    return res.rows(method=method, corpus=corpus)

                timed(method, "lira", len(members) + len(non), run_lira)
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
