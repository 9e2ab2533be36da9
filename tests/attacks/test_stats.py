"""scpdr.attacks.stats: bootstrap intervals, ROC metrics from scikit-learn, distinguishability."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.attacks.stats import (
    Estimate,
    bootstrap_ci,
    distinguishable,
    pairwise_weighted_roc,
    ranked_weighted_roc,
    roc_metrics,
    tpr_at_fpr,
    weighted_roc,
)

finite = st.floats(-1e6, 1e6, allow_nan=False)


def _mann_whitney(mem, non):
    """AUC by its definition: P(member score > non-member score) + P(tie) / 2."""
    pairs = list(itertools.product(mem, non))
    return sum((a > b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=12), st.lists(finite, min_size=1, max_size=12))
def test_auc_is_the_mann_whitney_statistic(mem, non):
    met = roc_metrics(mem, non, n_boot=20)
    assert met.auc.value == pytest.approx(_mann_whitney(mem, non), abs=1e-12)
    assert met.n_members == len(mem) and met.n_nonmembers == len(non)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=2, max_size=15), st.lists(finite, min_size=2, max_size=15))
def test_every_interval_contains_its_estimate_and_tpr_grows_with_fpr(mem, non):
    met = roc_metrics(mem, non, n_boot=50, fpr_levels=(0.001, 0.01, 0.5))
    for est in (met.auc, *met.tpr.values()):
        assert est.ci_low <= est.value <= est.ci_high
        assert 0.0 <= est.ci_low and est.ci_high <= 1.0
    t = [met.tpr[lv].value for lv in (0.001, 0.01, 0.5)]
    assert t == sorted(t)


def test_tpr_at_fpr_reads_the_largest_tpr_within_the_level():
    fpr = np.array([0.0, 0.0, 0.005, 0.02, 1.0])
    tpr = np.array([0.0, 0.3, 0.5, 0.9, 1.0])
    assert tpr_at_fpr(fpr, tpr, 0.01) == 0.5
    assert tpr_at_fpr(fpr, tpr, 0.001) == 0.3
    assert tpr_at_fpr(fpr, tpr, 1.0) == 1.0


def test_separated_scores_give_auc_one_and_full_tpr_and_reversed_ones_auc_zero():
    mem, non = np.arange(100, 200), np.arange(0, 100)
    met = roc_metrics(mem, non, n_boot=50)
    assert met.auc.value == 1.0 and met.tpr[0.01].value == 1.0 and met.tpr[0.001].value == 1.0
    assert (met.auc.ci_low, met.auc.ci_high) == pytest.approx((1.0, 1.0))
    flipped = roc_metrics(non, mem, n_boot=50)
    assert flipped.auc.value == 0.0 and flipped.tpr[0.01].value == 0.0


def test_roc_needs_both_classes_and_finite_scores():
    with pytest.raises(ValueError, match="members and non-members"):
        roc_metrics([1.0, 2.0], [])
    with pytest.raises(ValueError, match="NaN"):
        roc_metrics([1.0, float("nan")], [0.0])


def test_bootstrap_ci_of_a_mean_covers_the_truth_about_95_percent_of_the_time():
    # deterministic: 200 fixed samples of Bernoulli(0.3), n = 100 each
    rng = np.random.default_rng(1234)
    covered = 0
    for i in range(200):
        x = (rng.random(100) < 0.3).astype(float)
        est = bootstrap_ci(x, n_boot=400, seed=i)
        covered += est.contains(0.3)
    assert 0.88 <= covered / 200 <= 0.99


def test_bootstrap_ci_degenerate_and_small_samples():
    assert bootstrap_ci([2.0] * 10) == Estimate(2.0, 2.0, 2.0, 10)
    one = bootstrap_ci([3.0])
    assert one.value == 3.0 and np.isnan(one.ci_low) and one.n == 1
    none = bootstrap_ci([])
    assert none.n == 0 and np.isnan(none.value)
    a = bootstrap_ci(np.arange(50.0), seed=7)
    assert a == bootstrap_ci(np.arange(50.0), seed=7)  # deterministic given the seed
    med = bootstrap_ci(np.arange(51.0), np.median)
    assert med.value == 25.0 and med.ci_low < 25.0 < med.ci_high


def test_distinguishable_from_intervals():
    a = Estimate(0.9, 0.85, 0.95, 100)
    b = Estimate(0.5, 0.45, 0.55, 100)
    c = Estimate(0.52, 0.40, 0.64, 100)
    assert distinguishable(a, b) is True and distinguishable(b, a) is True
    assert distinguishable(b, c) is False
    assert distinguishable(b, b) is False
    assert distinguishable(Estimate(0, 0, 0, 5), Estimate(1, 1, 1, 5)) is True
    assert distinguishable(Estimate(0, 0, 0, 5), Estimate(0, 0, 0, 5)) is False
    assert distinguishable(a, Estimate(0.5, float("nan"), float("nan"), 1)) is None


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(-5, 5), min_size=1, max_size=30),
    st.lists(st.integers(-5, 5), min_size=1, max_size=30),
    st.integers(0, 2**31),
)
def test_weighted_roc_equals_scikit_learn_on_the_expanded_sample(mem, non, seed):
    # small integer scores: many ties; weights = bootstrap draw counts (zeros included)
    mem, non = np.asarray(mem, float), np.asarray(non, float)
    rng = np.random.default_rng(seed)
    v = rng.multinomial(mem.size, np.full(mem.size, 1 / mem.size), size=3)
    w = rng.multinomial(non.size, np.full(non.size, 1 / non.size), size=3)
    levels = (0.001, 0.01, 0.1, 0.5)
    auc, tprs = weighted_roc(mem, non, v, w, levels)
    for r in range(3):
        want = roc_metrics(np.repeat(mem, v[r]), np.repeat(non, w[r]), fpr_levels=levels, n_boot=1)
        assert auc[r] == pytest.approx(want.auc.value, abs=1e-12)
        for c, lv in enumerate(levels):
            assert tprs[r, c] == pytest.approx(want.tpr[lv].value, abs=1e-12), lv


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-3, 3).map(lambda x: round(x, 1)), min_size=1, max_size=40),
    st.lists(st.floats(-3, 3).map(lambda x: round(x, 1)), min_size=1, max_size=40),
    st.integers(0, 2**31),
)
def test_ranked_weighted_roc_equals_its_pairwise_definition(mem, non, seed):
    # rounded scores: ties within and across the two sets; weights with zeros
    mem, non = np.asarray(mem), np.asarray(non)
    rng = np.random.default_rng(seed)
    v = rng.multinomial(mem.size, np.full(mem.size, 1 / mem.size), size=4).astype(float)
    w = rng.multinomial(non.size, np.full(non.size, 1 / non.size), size=4).astype(float)
    levels = (0.01, 0.1, 0.5)
    auc, tprs = ranked_weighted_roc(mem, non, v, w, levels)
    want_auc, want_tprs = pairwise_weighted_roc(mem, non, v, w, levels)
    np.testing.assert_allclose(auc, want_auc, atol=1e-12)
    np.testing.assert_allclose(tprs, want_tprs, atol=1e-12)


def test_pooled_mean_resamples_whole_examples():
    from scpdr.attacks.stats import pooled_mean_ci

    # ten examples of 1 or 99 tokens: the pooled mean is over tokens, the interval over examples
    sums = np.array([1.0, 0.0] * 5)
    counts = np.array([1.0, 99.0] * 5)
    est = pooled_mean_ci(sums, counts, n_boot=400)
    assert est.value == pytest.approx(5 / 500) and est.n == 10
    assert est.ci_low <= est.value <= est.ci_high and est.ci_high > est.value
    same = pooled_mean_ci(np.full(8, 3.0), np.full(8, 6.0))
    assert (same.value, same.ci_low, same.ci_high) == (0.5, 0.5, 0.5)
    one = pooled_mean_ci([2.0], [4.0])
    assert one.value == 0.5 and np.isnan(one.ci_low)


def test_cluster_bootstrap_passes_resampled_example_indices():
    from scpdr.attacks.stats import cluster_bootstrap_ci

    vals = np.array([0.0, 1.0, 2.0, 3.0])
    seen = []

    def stat(idx):
        seen.append(idx)
        return float(vals[idx].mean())

    est = cluster_bootstrap_ci(4, stat, n_boot=50, seed=3)
    assert est.value == 1.5 and len(seen) == 51
    assert all(len(i) == 4 and set(i) <= {0, 1, 2, 3} for i in seen)
    assert 0.0 <= est.ci_low < 1.5 < est.ci_high <= 3.0
