"""Run a set of attacks against a set of scorers and collect result rows (``scpdr eval``).

- :class:`EvalData`: what the attacks need to know about the data — the target partition's
  training texts and Names2IDs records, the validation set, the canaries and their candidate
  space — built from a partition directory (:func:`EvalData.from_partitions`, the layout of
  ``scpdr.data.save_partitions``) or by hand.
- :func:`load_bundle_scorers`: one ``ProtectedLM`` per requested method over one copy of the
  bundle's models (result-row names as in DESIGN.md: ``"none"``, ``"cp-delta"``, ``"cp-kl"``,
  ``"cp-fuse"``, ``"cp-delta-r"``, ``"scp-delta-r-b"``, ``"scp-delta-r-c"``, ``"scp-delta"``).
- :func:`run_eval`: every attack on every scorer, with wall-clock timings. The No CP scorer
  (``"none"``) also yields the ``"none-val"`` rows (paper Table 3: the same attacks on data the
  model never saw — validation names, never-inserted canaries, validation texts for TTE).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scpdr.attacks.exposure import Canary, CanarySpace, canary_exposure
from scpdr.attacks.lira import LiRAResult, lira
from scpdr.attacks.pii import PIIRecord, pii_extraction
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer
from scpdr.attacks.tte import token_by_token_extraction
from scpdr.attacks.utility import utility
from scpdr.errors import ConfigError

__all__ = [
    "ATTACKS",
    "EVAL_METHODS",
    "EvalData",
    "EvalOptions",
    "EvalReport",
    "bundle_bases",
    "bundle_data_dir",
    "check_attacks",
    "load_bundle_scorers",
    "missing_data",
    "resolve_method",
    "run_eval",
]

log = logging.getLogger(__name__)

ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "lira", "utility")

#: Result-row method name → (``ProtectedLM`` method, base: None, "model" ('b') or "constant" ('c')).
EVAL_METHODS: dict[str, tuple[str, str | None]] = {
    "none": ("none", None),
    "cp-delta": ("cp-delta", None),
    "cp-kl": ("cp-kl", None),
    "cp-fuse": ("cp-fuse", None),
    "cp-delta-r": ("cp-delta-r", None),
    "scp-delta-r": ("scp-delta-r", "model"),
    "scp-delta-r-b": ("scp-delta-r", "model"),
    "scp-delta-r-c": ("scp-delta-r", "constant"),
    "scp-delta": ("scp-delta", "model"),
    "scp-delta-b": ("scp-delta", "model"),
    "scp-delta-c": ("scp-delta", "constant"),
}

_PII_PROMPT = re.compile(r"^Name: (?P<name>.+), ID:$")
_PII_RESPONSE = re.compile(r"^ (?P<id>\d+)$")


def resolve_method(name: str) -> tuple[str, str | None]:
    try:
        return EVAL_METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; known: {', '.join(EVAL_METHODS)}") from None


# ------------------------------------------------------------------------------------ data


@dataclass
class EvalData:
    """The data the attacks read. Lists may be empty: an attack without its data is skipped
    with a log line (``run_eval``)."""

    corpus: str = "data"
    train: list[str] = field(default_factory=list)
    validation: list[str] = field(default_factory=list)
    pii: list[PIIRecord] = field(default_factory=list)
    pii_val: list[PIIRecord] = field(default_factory=list)
    canaries: list[Canary] = field(default_factory=list)
    canary_space: CanarySpace | None = None
    # LiRA's examples: texts, or records (a prompted record is scored on its response given its
    # prompt, the paper's r(y|x)); None = ``train`` / ``validation``
    members: list[Any] | None = None
    nonmembers: list[Any] | None = None

    @staticmethod
    def pii_records(records: Sequence[Any]) -> list[PIIRecord]:
        """Names2IDs records (``prompt = "Name: <name>, ID:"``, ``response = " <digits>"``)."""
        out = []
        for r in records:
            p = _PII_PROMPT.match(getattr(r, "prompt", None) or "")
            q = _PII_RESPONSE.match(getattr(r, "response", None) or "")
            if p and q:
                out.append(PIIRecord(p["name"], q["id"]))
        return out

    @classmethod
    def from_partitions(
        cls,
        path: str | Path,
        *,
        target: int | None = None,
        corpus: str | None = None,
    ) -> EvalData:
        """Read a partition directory (``manifest.json``, ``partition-<i>.jsonl``,
        ``validation.jsonl``, ``canaries.json``). ``target``: the partition whose constituent
        (``constituent <target>``, the No CP model when 0) is attacked — default the canaries'
        partition, else 0. Canary copies are left out of the training texts."""
        from scpdr.data import load_partitions
        from scpdr.data.canaries import load_wordlist, wordlist_hash

        pset = load_partitions(path)
        reg = pset.canaries
        if target is None:
            target = reg.partition if reg is not None else 0
        if not 0 <= target < pset.k:
            raise ConfigError(f"target partition {target} does not exist (k = {pset.k})")
        canary_ids = {r.id for r in reg.records()} if reg is not None else set()
        part = [r for r in pset.parts[target] if r.id not in canary_ids]
        data = cls(
            corpus=corpus or str(pset.manifest.dataset.get("name") or Path(path).name),
            train=[r.text for r in part],
            validation=[r.text for r in pset.validation],
            pii=cls.pii_records(part),
            pii_val=cls.pii_records(pset.validation),
            members=list(part),
            nonmembers=list(pset.validation),
        )
        if reg is not None:
            words = load_wordlist()
            if wordlist_hash(words) != reg.wordlist_sha256:
                raise ConfigError(
                    f"{path}: the canaries were drawn from another word list than the installed "
                    "one; exposure needs the original list (re-create the partitions)"
                )
            data.canary_space = CanarySpace(tuple(words), n_words=reg.config.num_words)
            data.canaries = [Canary(c.prompt, tuple(c.words), c.repetitions) for c in reg.canaries]
        return data


@dataclass
class EvalOptions:
    """Sizes and knobs of :func:`run_eval` (``None`` = all)."""

    n_reference: int = 10_000
    enumerate_limit: int = 1 << 14
    batch_size: int = 16
    pii_n: int | None = None
    tte_n: int | None = 64
    tte_max_tokens: int | None = 256
    tte_q_fails: bool = False
    lira_n: int | None = None
    lira_max_tokens: int | None = 256
    utility_n: int | None = None
    utility_max_tokens: int | None = 256
    seed: int = 0


@dataclass
class EvalReport:
    rows: list[ResultRow] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    lira: dict[str, LiRAResult] = field(default_factory=dict)

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


def _take(xs: Sequence[Any] | None, n: int | None) -> list[Any]:
    xs = list(xs or [])
    return xs if n is None else xs[:n]


def _examples(data: EvalData, opts: EvalOptions) -> dict[str, tuple[list[Any], Any, str]]:
    """attack -> (examples, "none-val" examples or None, what is missing when there are none);
    LiRA's second item is its non-members."""
    return {
        "canary": (
            list(data.canaries) if data.canary_space is not None else [],
            None,
            "no canaries in the data",
        ),
        "pii": (
            _take(data.pii, opts.pii_n),
            _take(data.pii_val, opts.pii_n),
            "no Names2IDs records in the data",
        ),
        "tte": (
            _take(data.train, opts.tte_n),
            _take(data.validation, opts.tte_n),
            "no training texts",
        ),
        "lira": (
            _take(data.members if data.members is not None else data.train, opts.lira_n),
            _take(data.nonmembers if data.nonmembers is not None else data.validation, opts.lira_n),
            "no members or no non-members (training and validation examples)",
        ),
        "utility": (
            _take(data.validation, opts.utility_n),
            None,
            "no validation texts",
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


def run_eval(
    scorers: Mapping[str, Scorer],
    data: EvalData,
    attacks: Sequence[str],
    *,
    options: EvalOptions | None = None,
    reference: Callable[[str], Scorer | None] | Mapping[str, Scorer] | None = None,
    q_scorer: Scorer | None = None,
) -> EvalReport:
    """Run ``attacks`` (names of :data:`ATTACKS`) on every scorer; rows are named by the keys of
    ``scorers``. ``reference(method)`` (or a mapping) gives LiRA's reference scorer for a method
    (trained without the members); ``q_scorer`` enables TTE's "q fails" rows."""
    opts = options or EvalOptions()
    check_attacks(attacks)
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

    def timed_rows(
        method: str,
        attack: str,
        scorer: Scorer,
        examples: list[Any],
        rows_of: Callable[[Scorer, list[Any], str], list[ResultRow]],
        *,
        none_val: list[Any] | None = None,
    ) -> None:
        """``rows_of(scorer, examples, method)``, timed; under No CP also ``none_val`` (examples
        no constituent trained on), as the rows of method "none-val"."""
        timed(method, attack, len(examples), lambda: rows_of(scorer, examples, method))
        if method == "none" and none_val:
            timed("none-val", attack, len(none_val), lambda: rows_of(scorer, none_val, "none-val"))

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
        rows = res.rows(method=name, corpus=corpus)
        if name == "none":  # never-inserted canaries under No CP: "none-val"
            rows += _none_val_canary_rows(rows)
        return rows

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

    examples_of = _examples(data, opts)
    rows_of = {"canary": canary_rows, "pii": pii_rows, "tte": tte_rows, "utility": utility_rows}

    for method, scorer in scorers.items():
        for attack in attacks:
            if attack in rows_of:
                examples, none_val, missing = examples_of[attack]
                if not examples:
                    log.info("%s: %s, skipped", attack, missing)
                    continue
                timed_rows(method, attack, scorer, examples, rows_of[attack], none_val=none_val)
            elif attack == "lira":
                members, non, _ = examples_of["lira"]
                ref = ref_of(method)
                if not members or not non or ref is None:
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


def _none_val_canary_rows(rows: list[ResultRow]) -> list[ResultRow]:
    """The random-canary baseline under No CP as the ``none-val`` canary row (no repetitions:
    the main table's pooled value)."""
    out = []
    for r in rows:
        if r.extra.get("baseline"):
            extra = {k: v for k, v in r.extra.items() if k not in ("repetitions", "baseline")}
            metric = r.metric.removeprefix("baseline_")
            out.append(
                ResultRow("none-val", r.attack, metric, r.value, r.n, r.std, r.corpus, extra)
            )
    return out


# ------------------------------------------------------------------------------------ scorers


def bundle_data_dir(
    bundle: str | Path, manifest: Any, data: str | Path | None = None, *, instead: str = ""
) -> Path:
    """The partition directory of ``bundle``: ``data`` when given, else the manifest's
    ``extra.partitions`` (relative to the bundle; ``scpdr train`` records it). ``instead``
    names another option the error suggests (``"--prompts FILE or "``)."""
    if data is not None:
        return Path(data)
    rel = manifest.extra.get("partitions")
    if not rel:
        raise ConfigError(
            f"bundle {bundle} does not say where its data is (no extra.partitions); pass "
            f"{instead}--data DIR, the partition directory written by `scpdr partition`"
        )
    return Path(bundle) / rel


def bundle_bases(bundle: str | Path, manifest: Any, sources: Iterable[str | None]) -> Any:
    """Check that ``bundle`` has the bases that methods with these base ``sources`` (``"model"``
    for the '-b' variants, ``"constant"`` for '-c', None) need; return the constant base vector
    when one needs it, else None."""
    from scpdr import models as M

    sources = set(sources)
    if "model" in sources and manifest.base is None:
        raise ConfigError(
            f"bundle {bundle} has no base model: drop the '-b' methods from --methods, or "
            "re-bundle with a base (`scpdr bundle --base REF`)"
        )
    if "constant" not in sources:
        return None
    base_vector = M.load_constant_base(bundle, manifest)
    if base_vector is None:
        raise ConfigError(
            f"bundle {bundle} stores no constant base vector: drop the '-c' methods from "
            "--methods, or re-bundle with `scpdr bundle --held-out PROMPTS.txt` (stores it)"
        )
    return base_vector


def load_bundle_scorers(
    path: str | Path,
    methods: Sequence[str],
    *,
    m: int | None = None,
    dtype: Any = None,
    reference: str | None = None,
) -> tuple[dict[str, Scorer], Callable[[str], Scorer | None], Scorer | None]:
    """``(scorers, reference_of, q_scorer)`` for a bundle, loading each model once.

    ``reference``: a model ref for ``p_0`` (trained without the LiRA members); the reference of
    method X is then X over ``(p_0, constituents 1..K-1)`` — the worst case ``CP(p_0, q)`` of
    Theorem 4.5. Without it the reference is ``q`` (constituent 1 alone, Theorem 4.4's
    ``r_0 = q``), which never saw the target partition either. ``q_scorer`` is constituent 1
    alone (for TTE's "q fails" restriction), or None for a one-model bundle.
    """
    from scpdr import models as M
    from scpdr.protected import ProtectedLM

    specs = {name: resolve_method(name) for name in methods}
    manifest = M.read_bundle(path)
    # a base the methods need and the bundle lacks fails before any model loads
    base_vector = bundle_bases(path, manifest, [src for _, src in specs.values()])
    tok = M.load_tokenizer(manifest.resolve(path, manifest.tokenizer))
    cons = [M.load_model(manifest.resolve(path, r), dtype=dtype) for r in manifest.constituents]
    base_model = None
    if any(src == "model" for _, src in specs.values()):
        base_model = M.load_model(manifest.resolve(path, manifest.base), dtype=dtype)
    mm = manifest.m if m is None else m

    def build(models: list[Any], name: str) -> Scorer:
        method, src = specs[name]
        if method == "none":
            return ProtectedLM([models[0]], tok, method="none")
        return ProtectedLM(
            models,
            tok,
            base_model=base_model if src == "model" else None,
            base_vector=base_vector if src == "constant" else None,
            method=method,
            m=mm,
        )

    scorers = {name: build(cons, name) for name in methods}
    q_scorer = ProtectedLM([cons[1]], tok, method="none") if len(cons) > 1 else None
    refs: dict[str, Scorer] = {}
    p0 = M.load_model(reference, dtype=dtype) if reference is not None else None

    def reference_of(name: str) -> Scorer | None:
        if name not in refs:
            if p0 is not None:
                refs[name] = build([p0, *cons[1:]], name)
            elif q_scorer is not None:
                refs[name] = q_scorer
            else:
                return None
        return refs[name]

    return scorers, reference_of, q_scorer
