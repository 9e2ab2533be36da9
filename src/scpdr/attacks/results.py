"""The common result schema of every attack: rows ``{"method", "attack", "metric", "value", "n",
"std", "corpus", ...}`` saved as one JSON list (``docs/dev/contracts.md``, "Result rows").

A row is one number: one metric of one attack against one method (scorer) on one corpus. Extra
keys (``repetitions``, ``ci_low``/``ci_high``, ``within_2std_of_baseline``, ...) ride along in
``extra`` and are flattened into the JSON object.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scpdr import methods
from scpdr.errors import ScpdrError
from scpdr.io import atomic_write_json, read_json

__all__ = [
    "NO_CP_VAL",
    "STE",
    "ResultRow",
    "bootstrap_std",
    "load_results",
    "mean_and_std",
    "rows_to_dicts",
    "save_results",
]

_CORE = ("method", "attack", "metric", "value", "n", "std", "corpus")

#: The reference rows attacks and reports add (:data:`scpdr.methods.REFERENCE_METHODS`): No CP
#: attacked on data no constituent saw (paper Table 3's "No CP-val"), and the standard error of
#: its values (Table 3's "STE").
NO_CP_VAL, STE = methods.REFERENCE_METHODS


def _clean(value: Any) -> Any:
    """JSON-safe scalars: numpy → python, NaN/inf → None (JSON has neither)."""
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@dataclass(frozen=True)
class ResultRow:
    """One number of one attack on one method.

    ``value`` is the metric; ``n`` the number of units it averages (examples, tokens, canaries);
    ``std`` its standard deviation across those units (or a bootstrap std for order statistics,
    as the metric's docstring says); ``corpus`` names the data set; ``extra`` holds the rest.
    """

    method: str
    attack: str
    metric: str
    value: float
    n: int = 0
    std: float | None = None
    corpus: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "attack": self.attack,
            "metric": self.metric,
            "value": _clean(self.value),
            "n": int(self.n),
            "std": _clean(self.std),
            "corpus": self.corpus,
        }
        for key, val in self.extra.items():
            if key in _CORE:
                raise ValueError(f"extra key {key!r} collides with a core result-row field")
            out[key] = _clean(val)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResultRow:
        missing = [k for k in ("method", "attack", "metric", "value") if k not in d]
        if missing:
            raise ScpdrError(f"result row {dict(d)!r} lacks {missing}; was it written by scpdr?")
        value = d["value"]
        return cls(
            method=str(d["method"]),
            attack=str(d["attack"]),
            metric=str(d["metric"]),
            value=float("nan") if value is None else float(value),
            n=int(d.get("n") or 0),
            std=None if d.get("std") is None else float(d["std"]),
            corpus=d.get("corpus"),
            extra={k: v for k, v in d.items() if k not in _CORE},
        )


def rows_to_dicts(rows: Iterable[ResultRow | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [r.to_dict() if isinstance(r, ResultRow) else dict(r) for r in rows]


def save_results(
    rows: Iterable[ResultRow | Mapping[str, Any]], path: str | os.PathLike[str]
) -> Path:
    """Write rows as a JSON list, atomically."""
    return atomic_write_json(path, rows_to_dicts(rows))


def load_results(path: str | os.PathLike[str]) -> list[ResultRow]:
    data = read_json(path)
    if not isinstance(data, list):
        raise ScpdrError(f"{path}: expected a JSON list of result rows, got {type(data).__name__}")
    return [ResultRow.from_dict(d) for d in data]


def mean_and_std(values: Sequence[float] | np.ndarray) -> tuple[float, float, int]:
    """(mean, sample std with ddof=1 — 0 for a single value, NaN for none, n)."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    n = int(arr.size)
    if n == 0:
        return float("nan"), float("nan"), 0
    return float(arr.mean()), float(arr.std(ddof=1)) if n > 1 else 0.0, n


def bootstrap_std(
    values: Sequence[float] | np.ndarray,
    statistic: Any = np.mean,
    *,
    n_boot: int = 1000,
    seed: int = 0,
) -> float:
    """Bootstrap standard deviation of ``statistic(values)`` (used for percentiles, whose
    sampling error has no closed form). ``statistic`` must accept ``axis=-1``."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size < 2:
        return 0.0 if arr.size == 1 else float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_boot, arr.size))
    stats = statistic(arr[idx], axis=-1)
    return float(np.std(stats, ddof=1))
