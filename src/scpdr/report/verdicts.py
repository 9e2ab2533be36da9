"""A short plain-language verdict per method, from its result rows and their intervals: does the
method leak under extraction (canary, PII, TTE), do the data owner's declared secrets come out
because they were memorized (:func:`secrets_verdict`), does membership show (the strongest test of
the MIA suite: :func:`membership_verdict`), and what does it cost in utility.

Every comparison is :func:`scpdr.report.rows.differs` at 95% (the normal-approximation interval
of the difference, each standard error read off its own bootstrap interval, excludes 0):
extraction against No CP-val (the attack on data no model saw), membership against No CP-val's
AUC for the same test (else 0.5), utility against No CP. The strongest membership test is the one
whose AUC is farthest from 0.5 (either side: a flipped test leaks as much). Declared secrets are
compared, pair by pair, with their per-record chance level (the same query to the constituent(s)
that never saw the record): a secret that such a model produces too is guessable, one that only
the method produces whole was memorized (:mod:`scpdr.attacks.secrets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from scpdr import methods as M
from scpdr.attacks.mia import MIA_ATTACKS, MIA_LABELS, auc_distance
from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.cells import format_value
from scpdr.report.rows import differs, main_rows, ordered_methods, pick, row_value

__all__ = ["EXTRACTION_METRICS", "membership_verdict", "secrets_verdict", "verdicts"]

#: The extraction columns of the main table a verdict reads: (attack, label, [(metric label,
#: accepted metric names)]); an attack leaks when any of its metrics is above No CP-val's.
EXTRACTION_METRICS: tuple[tuple[str, str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("canary", "canary exposure", (("mean", ("exposure_mean", "mean")),)),
    ("pii", "PII", (("FER", ("fer",)), ("AEL", ("ael",)))),
    ("tte", "TTE", (("ACC", ("acc",)), ("AUC", ("auc",)))),
)


def _interval(r: Any) -> str:
    lo, hi = r.get("ci_low"), r.get("ci_high")
    if lo is None or hi is None:
        return format_value(row_value(r))
    return f"{format_value(row_value(r))} [{format_value(lo)}, {format_value(hi)}]"


def _extraction(rows: list[dict[str, Any]], method: str) -> str:
    leaks, chance, unknown = [], [], []
    for attack, label, metrics in EXTRACTION_METRICS:
        corpora = list(dict.fromkeys(r.get("corpus") for r in rows if r.get("attack") == attack))
        for corpus in corpora:
            name = label + (f" ({corpus})" if len(corpora) > 1 else "")
            found, tests = [], []
            for mlabel, names in metrics:
                r = pick(rows, method=method, attack=attack, metrics=names, corpus=corpus)
                ref = pick(rows, method=NO_CP_VAL, attack=attack, metrics=names, corpus=corpus)
                if r is None or ref is None:
                    continue
                d = differs(r, ref)
                tests.append(d)
                if d and (row_value(r) or 0.0) > (row_value(ref) or 0.0):
                    found.append(
                        f"{name} {mlabel} {_interval(r)} vs {format_value(row_value(ref))}"
                    )
            if found:
                leaks.append(found[0])
            elif tests and all(d is False or d is True for d in tests):
                chance.append(name)
            elif tests:
                unknown.append(name)
    parts = []
    if leaks:
        parts.append("above chance on " + "; ".join(leaks))
    if chance:
        parts.append("at chance on " + ", ".join(chance))
    if unknown:
        parts.append("no interval for " + ", ".join(unknown))
    return "extraction " + ("; ".join(parts) if parts else "not measured")


def _pct(x: Any) -> str:
    return "?" if x is None else f"{float(x):+.0%}"


def _p(row: Any) -> str:
    p = row.get("p_value")
    return "p = ?" if p is None else ("p < 0.001" if p < 0.001 else f"p = {p:.3g}")


def secrets_verdict(rows: Iterable[Any], method: str, *, corpus: str | None = None) -> str | None:
    """What came out of the declared secrets under ``method`` once their chance level is known:
    how many came out whole because a model without the record produces them too (guessable),
    how many because they were memorized (whole here, not from the counterfactual), and the
    paired tests against the chance level. None when the counterfactual was not measured."""
    rows = main_rows(rows)
    kw = {"method": method, "attack": "secrets", "corpus": corpus}
    fer = pick(rows, metrics=("fer",), **kw)
    guess = pick(rows, metrics=("guessable",), **kw)
    mem = pick(rows, metrics=("memorized",), **kw)
    mc = pick(rows, metrics=("fer_vs_counterfactual",), **kw)
    bs = pick(rows, metrics=("extracted_vs_counterfactual",), **kw)
    if fer is None or guess is None or mem is None or mc is None:
        return None
    n = int(fer.get("n") or 0)
    whole = round((row_value(fer) or 0.0) * n)
    k = int(mem.get("count") or 0)
    text = (
        f"secrets: {whole} of {n} came out whole — {whole - k} because a model without the "
        f"record produces them too (guessable; it produces {int(guess.get('count') or 0)} of "
        f"the {n} on its own), {k} because they were memorized ("
        f"{int(mem.get('records_with') or 0)} records: real leaks)"
    )
    lo, hi = mc.get("ci_low"), mc.get("ci_high")
    significant = (mc.get("p_value") is not None) and mc["p_value"] < 0.05
    how = "above" if (row_value(mc) or 0.0) > 0 else "below"
    text += (
        f"; whole-secret rate vs the chance level {_pct(row_value(mc))} [{_pct(lo)}, {_pct(hi)}], "
        f"McNemar exact {_p(mc)}: "
        + (f"{how} chance at 95%" if significant else "not distinguishable from chance at 95%")
    )
    if bs is not None:
        text += (
            f"; characters extracted vs the chance level {_pct(row_value(bs))} "
            f"[{_pct(bs.get('ci_low'))}, {_pct(bs.get('ci_high'))}] (paired bootstrap, {_p(bs)})"
        )
    return text


def membership_verdict(rows: Iterable[Any], method: str) -> str:
    """The strongest membership test of ``method`` against No CP-val's AUC for the same test
    (else 0.5), with its interval and TPR at 1% FPR."""
    return _membership(main_rows(rows), method)


def _membership(rows: list[dict[str, Any]], method: str) -> str:
    aucs = [
        r
        for r in rows
        if r.get("method") == method and r.get("attack") in MIA_ATTACKS and r.get("metric") == "auc"
    ]
    aucs = [r for r in aucs if row_value(r) is not None]
    if not aucs:
        return "membership not measured"
    best = max(aucs, key=lambda r: auc_distance(row_value(r) or 0.5))
    attack, corpus = best["attack"], best.get("corpus")
    ref = pick(rows, method=NO_CP_VAL, attack=attack, metrics=("auc",), corpus=corpus)
    if ref is None:  # the chance level itself
        ref = {"value": 0.5, "ci_low": 0.5, "ci_high": 0.5}
    tpr = pick(rows, method=method, attack=attack, metrics=("tpr@0.01fpr",), corpus=corpus)
    d = differs(best, ref)
    verdict = {True: "detectable", False: "not detectable", None: "unclear (no interval)"}[d]
    text = (
        f"membership {verdict}: strongest test {MIA_LABELS[attack]}, AUC {_interval(best)} "
        f"(No CP-val {format_value(row_value(ref))})"
    )
    if tpr is not None:
        text += f", TPR@1% FPR {_interval(tpr)}"
    return text


def _utility(rows: list[dict[str, Any]], method: str) -> str:
    metrics = ("accuracy", "acc")
    corpora = {r.get("corpus") for r in rows if r.get("attack") == "utility"}
    parts = []
    for corpus in corpora:
        r = pick(rows, method=method, attack="utility", metrics=metrics, corpus=corpus)
        ref = pick(rows, method="none", attack="utility", metrics=metrics, corpus=corpus)
        if r is None:
            continue
        if method == "none" or ref is None:
            parts.append(f"next-token accuracy {_interval(r)}")
            continue
        d = differs(r, ref)
        how = {True: "distinguishable", False: "not distinguishable", None: "no interval"}[d]
        parts.append(
            f"next-token accuracy {format_value(row_value(r))} vs No CP "
            f"{format_value(row_value(ref))} ({how})"
        )
    return "utility " + ("; ".join(parts) if parts else "not measured")


def verdicts(rows: Iterable[Any], *, methods: Sequence[str] | None = None) -> list[str]:
    """One line per method (in table order): ``"SCP-Δr-b: extraction ...; membership ...;
    utility ..."``."""
    rows = main_rows(rows)
    out = []
    for method in ordered_methods(rows, methods):
        if not any(r.get("method") == method for r in rows):
            continue
        parts = [_extraction(rows, method)]
        corpora = dict.fromkeys(r.get("corpus") for r in rows if r.get("attack") == "secrets")
        parts += [t for c in corpora if (t := secrets_verdict(rows, method, corpus=c))]
        parts += [_membership(rows, method), _utility(rows, method)]
        out.append(f"{M.label(method)}: " + "; ".join(parts) + ".")
    return out
