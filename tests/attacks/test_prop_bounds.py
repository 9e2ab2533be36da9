"""App. D.4 (Proposition 4.8 illustration): the fast path equals scpdr.bounds.v_x, closed forms in
the uniform scheme, and SCP-Δr's advantage when y_s is smoothed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scpdr import bounds
from scpdr.attacks.prop_bounds import (
    _draw,
    _spike,
    _v_x_fast,
    calibrate_q_scale,
    plot_prop_bounds,
    prop_bounds_experiment,
)
from scpdr.errors import ConfigError


@pytest.mark.parametrize(
    ("scheme", "method"),
    [
        ("maybe_smoothed", "cp-delta"),
        ("maybe_smoothed", "cp-delta-r"),
        ("maybe_smoothed", "scp-delta-r"),
        ("not_smoothed", "scp-delta-r"),
    ],
)
def test_fast_path_equals_bounds_v_x(scheme, method):
    d = _draw(scheme, n=300, trials=6, q_scale=4.5, gen=torch.Generator().manual_seed(1))
    y = torch.zeros(6, dtype=torch.long)
    lp1s = [_spike(d["p1"], v) for v in (0.1, 0.7)]
    fast = _v_x_fast(method, lp1s, d, y, 5)
    base = d["b"] if method == "scp-delta-r" else None
    for lp1, f in zip(lp1s, fast, strict=True):
        slow = bounds.v_x(method, torch.stack([lp1, d["q"]]), d["p0"], y, base=base, m=5)
        torch.testing.assert_close(f, slow, rtol=1e-4, atol=1e-5)


def test_spike_sets_the_target_and_keeps_a_distribution():
    d = _draw("smoothed", n=50, trials=3, q_scale=4.5, gen=torch.Generator().manual_seed(0))
    before = d["p1"].clone()
    lp = _spike(d["p1"], 0.3)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(lp[:, 0].exp(), torch.full((3,), 0.3))
    torch.testing.assert_close(d["p1"], before)  # input untouched


def test_uniform_scheme_closed_form_and_smoothed_advantage(tmp_path):
    n, vals = 2000, [0.1, 0.5, 0.9]
    res = prop_bounds_experiment(n=n, m=10, trials=12, p1_values=vals, seed=0)
    # uniform q = p0: v_x = D_m(p1, q) = -log(1 - v + 1/n) for CP-Δ (Remark 4.7)
    np.testing.assert_allclose(
        res.v["uniform"]["cp-delta"][:, 0], [-math.log(1 - v + 1 / n) for v in vals], rtol=1e-3
    )
    assert res.v["uniform"]["cp-delta"].std(axis=1).max() == 0.0
    # y_s smoothed (almost surely here): SCP-Δr's bound is far below CP-Δr's
    assert res.smoothed_q["smoothed"] > 0.9 and res.smoothed_q["not_smoothed"] < 0.2
    sm = res.v["smoothed"]
    assert sm["scp-delta-r"].mean() < 0.2 * sm["cp-delta-r"].mean()
    assert (sm["cp-delta-r"].mean(axis=1) <= sm["cp-delta"].mean(axis=1) + 1e-6).all()
    d = res.to_dict()
    assert d["schemes"]["smoothed"]["p_value_scp_vs_cp_delta_r"][0] < 1e-3
    assert len(d["schemes"]["uniform"]["methods"]["cp-delta"]["mean"]) == 3
    png = plot_prop_bounds(res, tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_calibrated_scale_smooths_half_the_trials():
    scale = calibrate_q_scale(n=2000, m=10, trials=40, seed=0)
    res = prop_bounds_experiment(
        n=2000, m=10, trials=40, p1_values=[0.5], schemes=["maybe_smoothed"], q_scale=scale
    )
    assert 0.3 <= res.smoothed_q["maybe_smoothed"] <= 0.7
    assert res.to_dict()["q_scale"] == pytest.approx(scale)


@pytest.mark.parametrize("q_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_q_scale_must_be_a_positive_finite_factor(q_scale):
    with pytest.raises(ConfigError, match="q_scale must be a finite factor > 0"):
        prop_bounds_experiment(n=100, m=10, trials=2, q_scale=q_scale)
