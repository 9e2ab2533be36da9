"""An operating point for the user (``docs/accountant.md``, "Budgets and attacks"): of the budget
sweep's settings (rows ``attack == "budget"``, ``extra.mode`` stop | fallback | anchor with
``budget`` or ``anchor``, :mod:`scpdr.attacks.budget_modes`), the one with the best utility
(next-token accuracy, then tokens per greedy answer) that is *at chance*:

- every membership test of the suite: its AUC interval contains .5 or its AUC is not
  distinguishable (:func:`scpdr.attacks.stats.distinguishable`) from the No CP-val row's AUC of
  the same test, and its TPR@1% interval does not lie above .01 (its lower end is at most .01:
  an interval entirely below .01, as few non-members give, is no evidence of leakage);
- secret extraction (only when the data declares secrets, i.e. the rows have ``secrets`` rows):
  the method's ``fer`` and ``extracted`` not distinguishable from No CP-val's. The sweep does not
  measure secrets per setting; the method's unbudgeted extraction stands for every setting
  (a budget or an anchor serves no more of the private aggregate than no budget does).

:func:`recommend` is pure (rows in, a :class:`Recommendation` out); :func:`recommendation_line`
says it in one line with the ``scpdr serve`` flags that deploy it, or that no setting of the grid
reaches chance and what the best one costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scpdr.attacks.mia import metric_name
from scpdr.attacks.results import NO_CP_VAL
from scpdr.attacks.stats import Estimate, distinguishable

#: The membership tests' TPR at 1% FPR.
_TPR = metric_name(0.01)

__all__ = [
    "Recommendation",
    "operating_points_text",
    "recommend",
    "recommendation_line",
    "serve_flags",
]

_CHANCE_TPR = 0.01


@dataclass(frozen=True)
class Recommendation:
    """The chosen setting: ``reached`` whether it is at chance (else: the setting with the
    lowest strongest TPR@1%, then the best utility), the strongest test (highest TPR@1%) with
    its TPR@1% and interval, accuracy and tokens per answer (NaN when not measured)."""

    method: str
    mode: str
    budget: float | None
    anchor: float | None
    reached: bool
    test: str
    tpr: float
    tpr_low: float
    tpr_high: float
    accuracy: float
    tokens_per_answer: float


def _get(r: Mapping[str, Any], key: str) -> Any:
    extra = r.get("extra") or {}
    return r.get(key, extra.get(key) if isinstance(extra, Mapping) else None)


def _est(r: Mapping[str, Any]) -> Estimate:
    v = float(r["value"])
    lo, hi = _get(r, "ci_low"), _get(r, "ci_high")
    return Estimate(v, math.nan if lo is None else float(lo), math.nan if hi is None else float(hi),
                    int(r.get("n") or 0))  # fmt: skip


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def serve_flags(method: str, mode: str, budget: float | None, anchor: float | None) -> str:
    """The ``scpdr serve`` flags of a setting (``--method`` and the budget or the anchor)."""
    flags = [f"--method {method}"]
    if mode == "anchor":
        flags.append(f"--anchor {anchor:g}")
    elif budget is not None:
        flags.append(f"--budget {budget:g} --on-budget {'base' if mode == 'fallback' else 'stop'}")
    return " ".join(flags)


def _secrets_ok(rows: list[Mapping[str, Any]], method: str) -> bool:
    """The method's secret extraction within CI of No CP-val's (True without secrets rows)."""
    sec = {(r["method"], r["metric"]): r for r in rows if r.get("attack") == "secrets"}
    for metric in ("fer", "extracted"):
        mine, val = sec.get((method, metric)), sec.get((NO_CP_VAL, metric))
        if mine is None or mine.get("value") is None:
            continue
        if val is None or val.get("value") is None:
            return False  # declared secrets without a chance level: not shown at chance
        if distinguishable(_est(mine), _est(val)) is not False:
            return False
    return True


def recommend(
    rows: Iterable[Mapping[str, Any]],
    *,
    method: str | None = None,
    modes: Iterable[str] | None = None,
) -> Recommendation | None:
    """The setting of the budget sweep with the best utility whose strongest membership test
    (and secret extraction, when declared) is within CI of the validation row; when none is,
    the setting closest to it (lowest strongest TPR@1%, then best utility) with ``reached``
    False. None when no setting has membership rows. Ties in utility go to the smaller budget /
    anchor (the stronger certificate), then to the method's name. ``method`` / ``modes``
    restrict the settings considered (e.g. the stop rule alone, to compare at one guarantee)."""
    allowed = None if modes is None else set(modes)
    rows = [r for r in rows if r.get("value") is not None]
    val_auc = {
        str(r["attack"]): _est(r)
        for r in rows
        if r.get("method") == NO_CP_VAL and r.get("metric") == "auc"
    }
    groups: dict[tuple[Any, ...], dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("attack") != "budget" or _get(r, "mode") is None:
            continue
        if method is not None and r.get("method") != method:
            continue
        if allowed is not None and _get(r, "mode") not in allowed:
            continue
        key = (str(r["method"]), str(_get(r, "mode")), _get(r, "budget"), _get(r, "anchor"))
        groups.setdefault(key, {})[str(r["metric"])] = r
    found: list[tuple[tuple[Any, ...], Recommendation]] = []
    for (meth, mode, budget, anchor), metrics in groups.items():
        tests = sorted(m[: -len(_TPR) - 1] for m in metrics if m.endswith(f"_{_TPR}"))
        if not tests:
            continue
        ok = _secrets_ok(rows, meth)
        strongest, best = "", -math.inf
        for t in tests:
            tpr = _est(metrics[f"{t}_{_TPR}"])
            ok = ok and tpr.ci_low <= _CHANCE_TPR  # not above chance (below it is no leak)
            if tpr.value > best:
                strongest, best = t, tpr.value
            auc = metrics.get(f"{t}_auc")
            if auc is not None:
                a = _est(auc)
                near = t in val_auc and distinguishable(a, val_auc[t]) is False
                ok = ok and (a.contains(0.5) or near)
        tr = _est(metrics[f"{strongest}_{_TPR}"])
        acc = _num((metrics.get("accuracy") or {}).get("value"))
        tpa = _num((metrics.get("tokens_per_answer") or {}).get("value"))
        rec = Recommendation(meth, mode, budget, anchor, ok, strongest, tr.value, tr.ci_low,
                             tr.ci_high, acc, tpa)  # fmt: skip
        size = anchor if mode == "anchor" else budget
        util = (-(acc if math.isfinite(acc) else -1.0), -(tpa if math.isfinite(tpa) else -1.0))
        tie = (math.inf if size is None else float(size), meth, mode)
        found.append(((not ok, tr.value if not ok else 0.0, *util, *tie), rec))
    if not found:
        return None
    return min(found, key=lambda f: f[0])[1]


def recommendation_line(rec: Recommendation | None, bundle: str = "BUNDLE") -> str:
    """One line: the setting and the ``scpdr serve`` command that deploys it, or that no setting
    of the grid reaches chance and what the best one costs."""
    if rec is None:
        return "Recommendation: none — the budget sweep measured no membership test."
    what = (
        f"{rec.method} {rec.mode}"
        + (f" c = {rec.anchor:g}" if rec.mode == "anchor" else "")
        + (
            ""
            if rec.mode == "anchor"
            else " B = ∞"
            if rec.budget is None
            else f" B = {rec.budget:g}"
        )
    )
    cost = (
        f"strongest test {rec.test} TPR@1% {rec.tpr:.3g} [{rec.tpr_low:.3g}, {rec.tpr_high:.3g}], "
        f"accuracy {rec.accuracy:.3g}, {rec.tokens_per_answer:.3g} tokens per answer"
    )
    cmd = f"scpdr serve {bundle} {serve_flags(rec.method, rec.mode, rec.budget, rec.anchor)}"
    if rec.reached:
        return (f"Recommendation: {what} — every membership test within CI of chance / No CP-val "
                f"and the best utility of those that are ({cost}); deploy: {cmd}")  # fmt: skip
    return (f"Recommendation: no setting of the grid reaches chance; the closest is {what} "
            f"({cost}; deploy: {cmd}) — try smaller budgets or anchors.")  # fmt: skip


def _setting_text(rec: Recommendation) -> str:
    size = (
        f"c = {rec.anchor:g}"
        if rec.mode == "anchor"
        else "B = ∞"
        if rec.budget is None
        else f"B = {rec.budget:g}"
    )
    return (
        f"{rec.mode} {size} (accuracy {rec.accuracy:.3g}, {rec.tokens_per_answer:.3g} tokens per "
        f"answer; strongest test {rec.test} TPR@1% {rec.tpr:.3g} [{rec.tpr_low:.3g}, "
        f"{rec.tpr_high:.3g}])"
    )


def operating_points_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """Per budgeted method, one sentence: the best setting at chance over every serving mode, the
    stop rule's best at the same guarantee, and the unbudgeted utility they are measured
    against (the report's "Privacy–utility frontier"); empty without budget rows."""
    rows = [r for r in rows if r.get("value") is not None]
    methods = sorted({str(r["method"]) for r in rows if r.get("attack") == "budget"})
    out: list[str] = []
    for m in methods:
        best, stop = recommend(rows, method=m), recommend(rows, method=m, modes=("stop",))
        if best is None or stop is None:
            continue
        free = [
            r for r in rows
            if r.get("attack") == "budget" and r.get("method") == m and _get(r, "mode") == "stop"
            and _get(r, "budget") is None
        ]  # fmt: skip
        acc = _num(next((r["value"] for r in free if r["metric"] == "accuracy"), None))
        tpa = _num(next((r["value"] for r in free if r["metric"] == "tokens_per_answer"), None))
        head = "at chance: " if best.reached else "no setting at chance; closest: "
        tail = "at chance: " if stop.reached else "not at chance; closest: "
        out.append(
            f"{m} — {head}{_setting_text(best)}; the stop rule {tail}{_setting_text(stop)}; "
            f"unbudgeted: accuracy {acc:.3g}, {tpa:.3g} tokens per answer."
        )
    return " ".join(out)
