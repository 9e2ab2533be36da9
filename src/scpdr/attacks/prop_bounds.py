"""The synthetic illustration of Proposition 4.8 (App. D.4, Fig. "prop_bounds").

Proposition 4.8 says the LiRA bound ``v_x(y)`` of Theorem 4.5 is small for SCP-Δr when the target
token ``y`` is smoothed in both ``rq~`` and ``rp~_0``. The experiment fixes a target token ``y_s``,
draws ``p_0, p_1, q, b`` over ``n`` tokens, raises ``p_1(y_s)`` step by step and measures
``v_x(y_s)`` for CP-Δ (Remark 4.7), CP-Δr and SCP-Δr (Thm. 4.5), under four initializations:

- ``uniform``: ``q = p_0 = b`` uniform, ``p_1`` uniform except the spike at ``y_s`` (CP-Δr and
  SCP-Δr then nearly coincide);
- ``smoothed``: a shared ``w ~ N(0, 1)`` and each distribution ``Softmax(w + N(0, 1))``; ``y_s``
  is smoothed with probability about ``(n - m)/n``;
- ``maybe_smoothed``: as ``smoothed`` with ``q(y_s)`` multiplied by 4.5 (then renormalized),
  which the paper found smooths ``y_s`` with probability about 0.5 for m = 10, n = 32000;
- ``not_smoothed``: as ``smoothed`` with ``q(y_s) = max_y q(y)``: ``y_s`` is almost never smoothed.

``p_1`` is ``Softmax(w + N(0, 1))`` (uniform in the first scheme) with ``p_1(y_s)`` set to each value
of the grid and the other tokens rescaled to sum to ``1 - p_1(y_s)``. The random draws of a trial are
shared by all grid values. All trials of a grid value run as one batch (``Tensor[trials, n]``),
so the paper's setting (n = 32000, m = 10, 200 trials) takes seconds. The result records, per
scheme, method and grid value, the mean and standard deviation of ``v_x(y_s)`` over the trials,
the fraction of trials in which ``y_s`` was actually smoothed in ``q`` and in ``p_0``, and the
paired t-test p-value of SCP-Δr against CP-Δr.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from scpdr.errors import ConfigError

__all__ = [
    "DEFAULT_P1_VALUES",
    "PROP_METHODS",
    "SCHEMES",
    "PropBoundsResult",
    "calibrate_q_scale",
    "plot_prop_bounds",
    "prop_bounds_experiment",
]

SCHEMES: tuple[str, ...] = ("uniform", "smoothed", "maybe_smoothed", "not_smoothed")
SCHEME_TITLES = {
    "uniform": "uniform with spike at y_s",
    "smoothed": "y_s smoothed",
    "maybe_smoothed": "y_s smoothed w.p. ≈ 0.5",
    "not_smoothed": "y_s not smoothed",
}
PROP_METHODS: tuple[str, ...] = ("cp-delta", "cp-delta-r", "scp-delta-r")
DEFAULT_P1_VALUES: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99)
Y_S = 0  # the target token (its index is irrelevant: the draws are exchangeable)


@dataclass
class PropBoundsResult:
    """``v[scheme][method]``: ``float64[len(p1_values), trials]`` values of ``v_x(y_s)`` (nats);
    ``smoothed_q`` / ``smoothed_p0``: the fraction of trials with ``y_s`` smoothed in ``q`` /
    ``p_0`` per scheme."""

    n: int
    m: int
    trials: int
    seed: int
    p1_values: list[float]
    v: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    smoothed_q: dict[str, float] = field(default_factory=dict)
    smoothed_p0: dict[str, float] = field(default_factory=dict)
    q_scale: float = 4.5

    def p_values(self, scheme: str, a: str = "scp-delta-r", b: str = "cp-delta-r") -> list[float]:
        """Paired t-test p-value of ``a`` vs ``b`` at each grid value (NaN when identical)."""
        from scipy import stats

        out = []
        for xa, xb in zip(self.v[scheme][a], self.v[scheme][b], strict=True):
            d = xa - xb
            if np.allclose(d, d[0]) or len(d) < 2:
                out.append(float("nan"))
            else:
                out.append(float(stats.ttest_rel(xa, xb).pvalue))
        return out

    def to_dict(self) -> dict[str, Any]:
        schemes = {}
        for s, per in self.v.items():
            schemes[s] = {
                "title": SCHEME_TITLES.get(s, s),
                "smoothed_fraction_q": self.smoothed_q.get(s),
                "smoothed_fraction_p0": self.smoothed_p0.get(s),
                "methods": {
                    m: {"mean": arr.mean(axis=1).tolist(), "std": arr.std(axis=1, ddof=1).tolist()}
                    for m, arr in per.items()
                },
            }
            if "scp-delta-r" in per and "cp-delta-r" in per:
                pv = self.p_values(s)
                schemes[s]["p_value_scp_vs_cp_delta_r"] = [None if math.isnan(p) else p for p in pv]
        return {
            "experiment": "prop_bounds",
            "paper": "App. D.4, Proposition 4.8",
            "n": self.n,
            "m": self.m,
            "trials": self.trials,
            "seed": self.seed,
            "q_scale": self.q_scale,
            "p1_values": list(self.p1_values),
            "schemes": schemes,
        }


def _spike(logp: Tensor, value: float) -> Tensor:
    """``logp`` with ``p(y_s) = value`` and the other tokens rescaled to sum to ``1 - value``."""
    rest = torch.log1p(-logp[:, Y_S].exp().clamp(max=1 - 1e-7))  # log(1 - p(y_s))  (trials,)
    out = logp + (math.log1p(-value) - rest).unsqueeze(1)  # a new tensor: logp is untouched
    out[:, Y_S] = math.log(value)
    return out


def _draw(
    scheme: str, *, n: int, trials: int, q_scale: float, gen: torch.Generator
) -> dict[str, Tensor]:
    """log-probs ``(trials, n)`` of p0, p1 (before the spike), q and b."""
    if scheme == "uniform":
        u = torch.full((trials, n), -math.log(n))
        return {"p0": u, "p1": u.clone(), "q": u.clone(), "b": u.clone()}
    w = torch.randn(trials, n, generator=gen)
    d = {
        k: torch.log_softmax(w + torch.randn(trials, n, generator=gen), dim=-1)
        for k in ("p0", "p1", "q", "b")
    }
    q = d["q"].clone()
    if scheme == "maybe_smoothed":
        q[:, Y_S] += math.log(q_scale)
    elif scheme == "not_smoothed":
        q[:, Y_S] = q.max(dim=-1).values
    elif scheme != "smoothed":
        raise ConfigError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    d["q"] = torch.log_softmax(q, dim=-1)
    return d


def _v_x_fast(
    method: str, lp1s: Sequence[Tensor], d: dict[str, Tensor], y: Tensor, m: int
) -> list[Tensor]:
    """``v_x(y)`` of Theorem 4.5 (Remark 4.7 for CP-Δ) for several ``p_1`` sharing ``(p_0, q, b)``:
    the ``r_0 = CP(p_0, q)`` terms are computed once. Same formula as :func:`scpdr.bounds.v_x`
    (``tests/attacks/test_prop_bounds.py`` checks they agree)."""
    from scpdr import bounds, naf

    base = d["b"] if method in naf.SCP_METHODS else None
    log_r0, c0 = bounds.naf_components(method, torch.stack([d["p0"], d["q"]]), base=base, m=m)
    rows = torch.arange(y.shape[0])
    if method == "cp-delta":
        term0 = (c0[1] - c0[0]).clamp_min(0.0)[rows, y]  # log max(1, q/p0)
    else:
        lrq = c0[1] - c0[1].mean(dim=-1, keepdim=True)
        lrp0 = c0[0] - c0[0].mean(dim=-1, keepdim=True)
        term0 = (lrq - lrp0).clamp_min(0.0)[rows, y] - log_r0.mean(dim=-1)  # ... - log tr0
    del log_r0, c0
    out = []
    for lp1 in lp1s:
        log_r1, c1 = bounds.naf_components(method, torch.stack([lp1, d["q"]]), base=base, m=m)
        if method == "cp-delta":
            v = term0 + bounds.max_divergence(log_r1, c1).amax(dim=0)  # + D_m(p1, q)
        else:
            kx = bounds.relative_max_divergence(log_r1, c1).amax(dim=0)  # D_r(p1, q)
            v = term0 + log_r1.mean(dim=-1) + kx  # + log tr1 + k_x
        out.append(v)
    return out


def _smoothed_fraction(lq: Tensor, lb: Tensor, m: int) -> float:
    from scpdr import naf

    kept = (naf.kept_tokens(lq, lb, m) == Y_S).any(dim=-1)
    return float((~kept).float().mean())


def calibrate_q_scale(
    *, n: int = 32_000, m: int = 10, trials: int = 200, target: float = 0.5, seed: int = 0
) -> float:
    """The factor on ``q(y_s)`` that smooths ``y_s`` in ``q`` in a fraction ``target`` of the
    trials of the ``maybe_smoothed`` draws (bisection in log space; 24 steps)."""
    gen = torch.Generator().manual_seed(seed * 1000 + SCHEMES.index("maybe_smoothed"))
    d = _draw("smoothed", n=n, trials=trials, q_scale=1.0, gen=gen)
    lo, hi = 0.0, math.log(float(n))
    for _ in range(24):
        mid = (lo + hi) / 2
        q = d["q"].clone()
        q[:, Y_S] += mid
        frac = _smoothed_fraction(torch.log_softmax(q, dim=-1), d["b"], m)
        lo, hi = (mid, hi) if frac > target else (lo, mid)
    return math.exp((lo + hi) / 2)


def prop_bounds_experiment(
    *,
    n: int = 32_000,
    m: int = 10,
    trials: int = 200,
    p1_values: Sequence[float] = DEFAULT_P1_VALUES,
    schemes: Sequence[str] = SCHEMES,
    methods: Sequence[str] = PROP_METHODS,
    q_scale: float | None = 4.5,
    seed: int = 0,
) -> PropBoundsResult:
    """Run the App. D.4 experiment (see the module docstring). ``q_scale`` is the factor on
    ``q(y_s)`` of the ``maybe_smoothed`` scheme (the paper's 4.5); ``None`` calibrates it so
    that ``y_s`` is smoothed in half the trials (:func:`calibrate_q_scale`)."""
    from scpdr import bounds

    if n < 2 or not 1 <= m < n or trials < 2:
        raise ConfigError(
            f"need n >= 2, 1 <= m < n and trials >= 2; got n={n}, m={m}, trials={trials}"
        )
    if not all(0.0 < v < 1.0 for v in p1_values):
        raise ConfigError(f"p1 values must lie in (0, 1), got {list(p1_values)}")
    bad = [x for x in methods if x not in bounds.V_X_METHODS]
    if bad:
        raise ConfigError(f"no v_x bound for {bad}; known: {list(bounds.V_X_METHODS)}")
    if q_scale is not None and not (math.isfinite(q_scale) and q_scale > 0):
        raise ConfigError(
            f"q_scale must be a finite factor > 0 (or None: calibrate), got {q_scale}"
        )
    if q_scale is None:
        q_scale = calibrate_q_scale(n=n, m=m, trials=trials, seed=seed)
    res = PropBoundsResult(
        n=n, m=m, trials=trials, seed=seed, p1_values=[float(v) for v in p1_values]
    )
    res.q_scale = float(q_scale)
    for scheme in schemes:
        if scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
        gen = torch.Generator().manual_seed(seed * 1000 + SCHEMES.index(scheme))
        # the uniform scheme is deterministic: one row stands for every trial
        rows = 1 if scheme == "uniform" else trials
        d = _draw(scheme, n=n, trials=rows, q_scale=q_scale, gen=gen)
        res.smoothed_q[scheme] = _smoothed_fraction(d["q"], d["b"], m)
        res.smoothed_p0[scheme] = _smoothed_fraction(d["p0"], d["b"], m)
        y = torch.full((rows,), Y_S, dtype=torch.long)
        lp1s = [_spike(d["p1"], float(val)) for val in p1_values]
        per = {}
        for meth in methods:
            vs = _v_x_fast(meth, lp1s, d, y, m)  # one (rows,) tensor per grid value
            arr = torch.stack(vs).double().numpy()  # (len(p1_values), rows)
            per[meth] = np.repeat(arr, trials, axis=1) if rows == 1 else arr
        res.v[scheme] = per
    return res


def plot_prop_bounds(result: PropBoundsResult, path: str | os.PathLike[str]) -> Path:
    """One panel per scheme: mean ``v_x(y_s)`` vs ``p_1(y_s)`` per method, error bars = one
    standard deviation (not the standard error), symlog y axis."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from scpdr.io import atomic_write

    schemes = list(result.v)
    fig, axes = plt.subplots(
        1, len(schemes), figsize=(4.0 * len(schemes), 3.4), squeeze=False, sharey=True
    )
    x = np.asarray(result.p1_values)
    labels = {"cp-delta": "CP-Δ", "cp-delta-r": "CP-Δr", "scp-delta-r": "SCP-Δr"}
    for ax, scheme in zip(axes[0], schemes, strict=True):
        for meth, arr in result.v[scheme].items():
            ax.errorbar(
                x,
                arr.mean(axis=1),
                yerr=arr.std(axis=1, ddof=1),
                fmt="-o",
                ms=3,
                capsize=2,
                label=labels.get(meth, meth),
            )
        ax.set_yscale("symlog", linthresh=1e-2)
        frac = result.smoothed_q.get(scheme)
        sub = f"\n(y_s smoothed in q: {frac:.1%})" if frac is not None else ""
        ax.set(xlabel="p1(y_s)", title=SCHEME_TITLES.get(scheme, scheme) + sub)
        ax.title.set_fontsize(9)
    axes[0][0].set_ylabel("v_x(y_s) (nats)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"Theorem 4.5 bound v_x(y_s), n={result.n}, m={result.m}, {result.trials} trials",
        fontsize=10,
    )
    fig.tight_layout()
    out = atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=130))
    plt.close(fig)
    return out
