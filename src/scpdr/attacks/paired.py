"""Paired tests: two measurements of the *same* examples compared pair by pair.

The secrets attack's per-record chance level (:mod:`scpdr.attacks.secrets`) measures each secret
twice — under a method and under the constituent(s) that never saw the record — so the
comparison is paired, and far more powerful than comparing two independent rates:

- :func:`mcnemar_exact`: a 0/1 outcome (the secret came out whole): McNemar's exact test, i.e.
  ``scipy.stats.binomtest`` on the discordant pairs;
- :func:`paired_bootstrap`: a number (the fraction of the secret's characters): the percentile
  bootstrap of the per-example differences.

Both return a :class:`PairedTest` (difference, 95% interval, p-value, n). Deterministic given
``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scpdr.attacks.stats import CI_LEVEL, N_BOOT, bootstrap_ci, bootstrap_replicates

__all__ = ["PairedTest", "mcnemar_exact", "paired_bootstrap"]


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or infinite values; drop or clip them first")
    return arr


@dataclass(frozen=True)
class PairedTest:
    """Two measurements ``a`` and ``b`` of the same ``n`` examples compared pair by pair:
    ``difference`` = mean(a) − mean(b) with its ``CI_LEVEL`` interval, the two-sided
    ``p_value`` of "no difference", the test's name, and for 0/1 outcomes the discordant pairs
    (``a_only``: a succeeded where b failed; ``b_only``: the reverse)."""

    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    test: str
    a_only: int | None = None
    b_only: int | None = None

    @property
    def significant(self) -> bool:
        """Whether the difference is distinguishable from 0 at ``CI_LEVEL``."""
        return bool(self.p_value < 1.0 - CI_LEVEL)

    def extra(self) -> dict[str, float | int | str | None]:
        """The result-row keys: ``ci_low``, ``ci_high``, ``p_value``, ``test`` (and the
        discordant counts of a McNemar test)."""
        out: dict[str, float | int | str | None] = {
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "p_value": self.p_value,
            "test": self.test,
        }
        if self.a_only is not None:
            out |= {"a_only": self.a_only, "b_only": self.b_only}
        return out


def _paired(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray):
    x, y = _as_1d(a, "a"), _as_1d(b, "b")
    if x.shape != y.shape:
        raise ValueError(
            f"paired samples differ in length ({x.size} vs {y.size}): pass one value of each "
            "measurement per example, in the same order"
        )
    return x, y


def mcnemar_exact(
    a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray, *, level: float = CI_LEVEL
) -> PairedTest:
    """McNemar's exact test of two 0/1 outcomes on the same examples: with ``a_only`` and
    ``b_only`` the discordant pairs, the two-sided ``scipy.stats.binomtest(a_only, a_only +
    b_only, 0.5)`` p-value (1 without discordant pairs). The interval of the difference of the
    success rates, ``(a_only − b_only) / n``, is the exact (Clopper–Pearson) interval of the
    discordant pairs' split, scaled by their share ``(a_only + b_only) / n``."""
    from scipy.stats import binomtest

    x, y = _paired(np.asarray(a, dtype=bool), np.asarray(b, dtype=bool))
    x, y = x.astype(bool), y.astype(bool)
    n = int(x.size)
    a_only, b_only = int(np.sum(x & ~y)), int(np.sum(~x & y))
    disc = a_only + b_only
    if n == 0:
        return PairedTest(float("nan"), float("nan"), float("nan"), 1.0, 0, "mcnemar-exact", 0, 0)
    if disc == 0:
        return PairedTest(0.0, 0.0, 0.0, 1.0, n, "mcnemar-exact", 0, 0)
    res = binomtest(a_only, disc, 0.5)
    ci = res.proportion_ci(confidence_level=level, method="exact")
    share = disc / n
    return PairedTest(
        (a_only - b_only) / n,
        share * (2.0 * ci.low - 1.0),
        share * (2.0 * ci.high - 1.0),
        float(res.pvalue),
        n,
        "mcnemar-exact",
        a_only,
        b_only,
    )


def paired_bootstrap(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> PairedTest:
    """The mean of the per-example differences ``a − b`` with a percentile-bootstrap interval
    (examples resampled with both their measurements); the two-sided p-value is twice the
    smaller share of replicates at or beyond 0 on either side (capped at 1). A constant
    difference gets the interval ``[d, d]`` and p = 0 unless d = 0."""
    x, y = _paired(a, b)
    d = x - y
    n = int(d.size)
    if n == 0:
        return PairedTest(float("nan"), float("nan"), float("nan"), 1.0, 0, "paired-bootstrap")
    est = bootstrap_ci(d, n_boot=n_boot, seed=seed, level=level)
    if n < 2:
        return PairedTest(est.value, est.ci_low, est.ci_high, 1.0, n, "paired-bootstrap")
    means = bootstrap_replicates(d, n_boot=n_boot, seed=seed)  # those of est's interval
    if np.all(means == 0.0):
        p = 1.0
    else:
        p = min(1.0, 2.0 * min(float(np.mean(means <= 0.0)), float(np.mean(means >= 0.0))))
    return PairedTest(est.value, est.ci_low, est.ci_high, p, n, "paired-bootstrap")
