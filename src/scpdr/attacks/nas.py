"""The normalized attack score (NAS), exactly as §5.4 "Main results" defines it (Table "Full
results", column NAS).

Every attack column (canary mean and 95th percentile, PII AEL and FER, TTE AUC and ACC per
corpus) is min-max normalized to [0, 1] across the methods (the rows, excluding the STE row),
and NAS is the weighted average of a method's normalized scores, TTE columns weighted 1/3 "to
balance the contribution of all attack types" (the paper reports TTE on three corpora, canary
and PII on one). In general each column of an attack weighs 1 / (the number of corpora that
attack is reported on), so every attack type counts equally whatever the corpora; the report's
main table uses the same rule and this function. All attack columns are "higher = more leakage",
so nothing is flipped; utility is not part of NAS. A column whose values are all equal
normalizes to 0. A method missing a column is averaged over the columns it has.

Membership inference (``scpdr.attacks.mia``) is not part of NAS (the paper's definition): a ROC
AUC below .5 is a flipped test — leakage, not protection — and min-max normalizing it as "lower is
better" would rank it the best. The report ranks those by ``|AUC − .5|`` in their own table. (TTE's
AUC is the accuracy–coverage area of selective classification, where lower is less extraction.)

**Training-time baselines** (:data:`scpdr.methods.BASELINE_METHODS`: Goldfish, the DP rows
dp-eps1 / dp-eps8, SCP-Δr-b + DP) are read on the scale the other rows set: every column's
minimum and maximum come from the paper's rows (the NAF methods, No CP, No CP-val), and a
baseline's values are normalized with them, not clipped. So adding a baseline never changes
another row's NAS (the paper's numbers stay comparable), and a baseline that leaks less than
every paper row on a column scores below 0 there (above 1: more than No CP).

On the paper's own table this gives No CP .99, CP-Δ .47, CP-Δ_KL .76, CP-Fuse .50, CP-Δr .22,
SCP-Δr-c .17, SCP-Δr-b .11, No CP-val .002 (``tests/attacks/test_nas.py`` checks it).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from scpdr.attacks.results import STE, ResultRow
from scpdr.methods import BASELINE_METHODS

__all__ = ["NAS_METRICS", "attack_weights_by_corpora", "nas", "nas_from_rows"]

#: (attack, metric) pairs that enter NAS.
NAS_METRICS: tuple[tuple[str, str], ...] = (
    ("canary", "exposure_mean"),
    ("canary", "exposure_p95"),
    ("pii", "ael"),
    ("pii", "fer"),
    ("tte", "auc"),
    ("tte", "acc"),
)


def attack_weights_by_corpora(columns: Iterable[tuple[str, Hashable, str]]) -> dict[str, float]:
    """Per-attack column weight 1 / (number of corpora the attack has columns for) (§5.4: with
    TTE on the paper's three corpora and canary/PII on one, TTE columns weigh 1/3)."""
    corpora: dict[str, set[Hashable]] = {}
    for attack, corpus, _ in columns:
        corpora.setdefault(attack, set()).add(corpus)
    return {attack: 1.0 / len(c) for attack, c in corpora.items()}


def nas(
    table: Mapping[str, Mapping[Hashable, float]],
    *,
    weights: Mapping[Hashable, float] | None = None,
    exclude: Iterable[str] = (STE,),
    scale_exclude: Iterable[str] = (),
) -> dict[str, float]:
    """NAS of every method in ``table`` (``{method: {column: value}}``; higher value = more
    leakage). ``weights`` maps a column to its weight (default 1). Rows named in ``exclude``
    (case-insensitive) take no part in the min-max and get no NAS; rows named in
    ``scale_exclude`` get a NAS on the scale the others set (their values neither lower the
    minimum nor raise the maximum, and may normalize outside [0, 1]) — unless no other row has
    the column."""
    skip = {e.lower() for e in exclude}
    rows = {m: cols for m, cols in table.items() if m.lower() not in skip}
    outside = {e.lower() for e in scale_exclude}
    scale_rows = {m: c for m, c in rows.items() if m.lower() not in outside}
    columns: list[Hashable] = []
    for cols in rows.values():
        for c in cols:
            if c not in columns:
                columns.append(c)
    lo, hi = {}, {}
    for c in columns:
        vals = [float(cols[c]) for cols in scale_rows.values() if c in cols and _finite(cols[c])]
        if not vals:  # only baselines have this column: they set its scale
            vals = [float(cols[c]) for cols in rows.values() if c in cols and _finite(cols[c])]
        if vals:
            lo[c], hi[c] = min(vals), max(vals)
    out = {}
    for m, cols in rows.items():
        total = wsum = 0.0
        for c in columns:
            if c not in lo or c not in cols or not _finite(cols[c]):
                continue
            w = 1.0 if weights is None else float(weights.get(c, 1.0))
            span = hi[c] - lo[c]
            norm = (float(cols[c]) - lo[c]) / span if span > 0 else 0.0
            total += w * norm
            wsum += w
        out[m] = total / wsum if wsum > 0 else float("nan")
    return out


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _get(row: ResultRow | Mapping[str, Any], key: str) -> Any:
    if isinstance(row, ResultRow):
        if hasattr(row, key) and key != "extra":
            return getattr(row, key)
        return row.extra.get(key)
    return row.get(key)


def nas_from_rows(
    rows: Iterable[ResultRow | Mapping[str, Any]],
    *,
    attack_weights: Mapping[str, float] | None = None,
    canary_repetitions: int | None = None,
    exclude: Iterable[str] = (STE,),
    scale_exclude: Iterable[str] = BASELINE_METHODS,
) -> tuple[dict[str, float], list[ResultRow]]:
    """NAS from result rows: one column per ``(attack, corpus, metric)`` of :data:`NAS_METRICS`.

    Canary columns use one repetition count: ``canary_repetitions``, else 3 (the paper's main
    setting) when present, else the largest — the choice the report's main table makes. A canary
    row without ``repetitions`` or with 0 (e.g. No CP-val: never-inserted canaries) is that
    method's value; ``baseline_*`` rows are not columns.

    ``attack_weights``: attack → weight of each of its columns; default
    :func:`attack_weights_by_corpora` (1 / the number of corpora the attack is reported on).

    ``scale_exclude``: rows read on the others' scale (default: the training-time baselines,
    :data:`scpdr.methods.BASELINE_METHODS`; see the module docstring).

    Returns ``({method: NAS}, rows)`` with rows ``(method, "nas", "nas", value)``."""
    wanted = set(NAS_METRICS)
    picked = [r for r in rows if (_get(r, "attack"), _get(r, "metric")) in wanted]
    reps = {
        int(_get(r, "repetitions"))
        for r in picked
        if _get(r, "attack") == "canary" and _get(r, "repetitions")
    }
    if canary_repetitions is None and reps:
        canary_repetitions = 3 if 3 in reps else max(reps)
    table: dict[str, dict[Hashable, float]] = {}
    for r in picked:
        attack, metric = _get(r, "attack"), _get(r, "metric")
        if attack == "canary":
            rep = _get(r, "repetitions")
            # repetitions None or 0 (e.g. No CP-val) is the method's one pooled value
            if _get(r, "baseline") or (rep and int(rep) != canary_repetitions):
                continue
        col = (attack, _get(r, "corpus"), metric)
        table.setdefault(str(_get(r, "method")), {})[col] = float(_get(r, "value"))
    columns = {col for cols in table.values() for col in cols}
    if attack_weights is None:
        attack_weights = attack_weights_by_corpora(columns)
    weights = {col: float(attack_weights.get(col[0], 1.0)) for col in columns}
    scores = nas(table, weights=weights, exclude=exclude, scale_exclude=scale_exclude)
    n_cols = len(weights)
    out_rows = [
        ResultRow(m, "nas", "nas", v, n_cols, None, None, {"columns": n_cols})
        for m, v in scores.items()
    ]
    return scores, out_rows
