"""Finding values in result rows ``{"method", "attack", "metric", "value", "n", "std", "corpus",
...}`` for the report's tables: the main run's rows, one (method, attack, metric, corpus) cell,
the STE of a No CP-val value, the corpora an attack ran on, the order of method rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scpdr import methods as M

__all__ = [
    "as_dict",
    "corpora_for",
    "differs",
    "estimate_of",
    "main_rows",
    "ordered_methods",
    "pick",
    "row_value",
    "ste_of",
]


def as_dict(row: Any) -> dict[str, Any]:
    if isinstance(row, Mapping):
        return dict(row)
    to_dict = getattr(row, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"result row must be a mapping, got {type(row).__name__}")


def main_rows(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Rows of the main run (not of a sweep point)."""
    return [r for r in map(as_dict, rows) if r.get("sweep") is None]


def pick(
    rows: Sequence[Mapping[str, Any]],
    *,
    method: str,
    attack: str,
    metrics: Sequence[str],
    corpus: str | None,
) -> Mapping[str, Any] | None:
    """The row of (method, attack, metric, corpus); for canaries with several repetition counts
    the pooled row (no ``repetitions``), else repetitions == 3 (the paper's main setting), else
    the largest."""
    for metric in metrics:
        cands = [
            r
            for r in rows
            if r.get("method") == method
            and r.get("attack") == attack
            and r.get("metric") == metric
            and (corpus is None or r.get("corpus") == corpus)
        ]
        if not cands:
            continue
        pooled = [r for r in cands if r.get("repetitions") is None]
        if pooled:
            return pooled[0]
        three = [r for r in cands if r.get("repetitions") == 3]
        if three:
            return three[0]
        # The largest repetition count; the baseline (0) only when it is all there is.
        return max(cands, key=lambda r: r.get("repetitions") or 0)
    return None


def row_value(row: Mapping[str, Any] | None) -> float | None:
    if row is None:
        return None
    v = row.get("value")
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def ste_of(row: Mapping[str, Any] | None) -> float | None:
    """Standard error std / sqrt(n) of a No CP-val value (the paper's STE row)."""
    if row is None or row.get("std") is None or not row.get("n"):
        return None
    n = int(row["n"])
    return float(row["std"]) / math.sqrt(n) if n > 0 else None


def corpora_for(rows: Sequence[Mapping[str, Any]], attack: str) -> list[str | None]:
    seen: dict[str | None, None] = {}
    for r in rows:
        if r.get("attack") == attack:
            seen.setdefault(r.get("corpus"))
    return list(seen)


def ordered_methods(rows: Sequence[Mapping[str, Any]], methods: Sequence[str] | None) -> list[str]:
    present = {r.get("method") for r in rows}
    if methods is not None:
        return [m for m in methods if m not in M.REFERENCE_METHODS]
    known = [m for m in M.METHOD_ORDER if m in present]
    other = sorted(m for m in present if m not in M.METHOD_ORDER and m not in M.REFERENCE_METHODS)
    return known + [m for m in other if isinstance(m, str)]


def estimate_of(row: Mapping[str, Any] | None) -> Any:
    """The row's :class:`scpdr.attacks.stats.Estimate` (value, 95% interval, n), or None when it
    has no value; the interval bounds are NaN when the row carries none."""
    from scpdr.attacks.stats import Estimate

    v = row_value(row)
    if row is None or v is None:
        return None
    lo, hi = row.get("ci_low"), row.get("ci_high")
    nan = float("nan")
    return Estimate(
        v,
        nan if lo is None else float(lo),
        nan if hi is None else float(hi),
        int(row.get("n") or 0),
    )


def differs(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool | None:
    """Whether two rows' values differ at 95% (:func:`scpdr.attacks.stats.distinguishable`: the
    normal-approximation interval of their difference, each standard error read off its own
    bootstrap interval, excludes 0); None when either lacks a value or an interval."""
    from scpdr.attacks.stats import distinguishable

    ea, eb = estimate_of(a), estimate_of(b)
    if ea is None or eb is None:
        return None
    return distinguishable(ea, eb)
