"""scpdr.attacks.mia: each attack's score on hand-made token statistics, and the result rows."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.attacks import mia

lps = st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=40)


def test_loss_min_k_and_ratio_on_a_known_sequence():
    lp = [-0.1, -5.0, -0.2, -3.0, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8]
    assert mia.loss_score(lp) == pytest.approx(np.mean(lp))
    # 20% of 10 tokens = the 2 lowest: -5 and -3
    assert mia.min_k_score(lp) == pytest.approx(-4.0)
    assert mia.min_k_score(lp, k=1.0) == pytest.approx(np.mean(lp))
    assert mia.min_k_score(lp[:3], k=0.2) == pytest.approx(-5.0)  # at least one token
    assert mia.ratio_score([-1.0, -2.0], [-3.0, -1.0]) == pytest.approx(1.0)


def test_zlib_divides_the_sequence_loglik_by_the_compressed_length():
    text = "Name: Ada Lovelace, ID: 1234567890"
    lp = [-1.0, -2.0, -0.5]
    assert mia.zlib_score(lp, text) == pytest.approx(-3.5 / len(zlib.compress(text.encode())))


def test_min_k_plus_plus_standardizes_by_the_next_token_distribution():
    # two positions over a 3-token vocabulary with known distributions
    dists = np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    logd = np.log(dists)
    mu = (dists * logd).sum(-1)
    sigma = np.sqrt((dists * logd**2).sum(-1) - mu**2)
    tokens = [1, 2]
    lp = logd[[0, 1], tokens]
    z0 = (lp[0] - mu[0]) / sigma[0]
    # position 1 is uniform: sigma 0, contributes 0
    assert sigma[1] == pytest.approx(0.0, abs=1e-6)
    got = mia.min_k_plus_plus_score(lp, mu, np.where(sigma < 1e-9, 0.0, sigma), k=1.0)
    assert got == pytest.approx((z0 + 0.0) / 2)
    with pytest.raises(ValueError, match="one value per scored token"):
        mia.min_k_plus_plus_score(lp, mu[:1], sigma)


@settings(max_examples=80, deadline=None)
@given(lps, st.floats(0.01, 1.0))
def test_min_k_is_between_the_minimum_and_the_mean_and_grows_with_k(lp, k):
    s = mia.min_k_score(lp, k=k)
    assert min(lp) - 1e-9 <= s <= np.mean(lp) + 1e-9
    assert mia.min_k_score(lp, k=1.0) >= s - 1e-9


@settings(max_examples=80, deadline=None)
@given(lps)
def test_every_reference_free_score_rises_when_every_token_gets_likelier(lp):
    lp = np.asarray(lp)
    hi = np.minimum(lp + 1.0, 0.0)  # each token at least as likely, one strictly (none at 0)
    if np.allclose(hi, lp):
        return
    mu, sd = np.full_like(lp, -2.0), np.ones_like(lp)
    a = mia.scores_from_stats(mia.ExampleStats(lp, mu, sd, "some text"))
    b = mia.scores_from_stats(mia.ExampleStats(hi, mu, sd, "some text"))
    for attack in mia.REFERENCE_FREE:
        assert b[attack] >= a[attack], attack


def test_empty_examples_and_bad_k_are_refused():
    with pytest.raises(ValueError, match="no scored tokens"):
        mia.loss_score([])
    with pytest.raises(ValueError, match="k must be in"):
        mia.min_k_score([-1.0], k=0.0)


def test_rows_carry_every_metric_with_cis_and_class_sizes():
    rng = np.random.default_rng(0)
    sc = mia.MIAScores("cp-delta")
    for x in rng.normal(1.0, 1.0, 120):
        sc.add("loss", member=True, score=x)
    for x in rng.normal(0.0, 1.0, 150):
        sc.add("loss", member=False, score=x)
    sc.add("ref", member=True, score=1.0)  # no non-members: no rows for ref
    rows = mia.mia_rows(sc, corpus="IDs", n_boot=100)
    assert {r.attack for r in rows} == {"loss"}
    assert [r.metric for r in rows] == list(mia.MIA_METRICS)
    assert mia.MIA_METRICS == ("auc", "tpr@0.01fpr", "tpr@0.001fpr")
    for r in rows:
        d = r.to_dict()
        assert d["n_members"] == 120 and d["n_nonmembers"] == 150 and d["n"] == 270
        assert d["ci_low"] <= d["value"] <= d["ci_high"]
    auc = next(r for r in rows if r.metric == "auc")
    # two unit normals one apart: AUC = Phi(1 / sqrt(2)) = 0.76
    assert auc.to_dict()["ci_low"] < 0.5 * (1 + math.erf(0.5)) < auc.to_dict()["ci_high"]
