"""Token-by-token extraction: the accuracy-coverage curve in closed form, and known answers."""

from __future__ import annotations

import numpy as np
import pytest
from attack_doubles import TOK, memorizing_scorer, uniform_scorer
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.attacks.tte import accuracy_coverage_curve, selective_auc, token_by_token_extraction

TEXTS = ["alpha beta gamma", "Delta epsilon", "zeta eta theta iota"]


def test_perfect_ranking_curve_is_closed_form():
    n, c = 10, 4  # 4 right predictions, all more confident than the 6 wrong ones
    conf = np.r_[np.linspace(0.9, 0.6, c), np.linspace(0.5, 0.1, n - c)]
    corr = np.r_[np.ones(c), np.zeros(n - c)]
    cov, acc = accuracy_coverage_curve(conf, corr)
    k = np.arange(1, n + 1)
    np.testing.assert_allclose(cov, k / n)
    np.testing.assert_allclose(acc, np.minimum(k, c) / k)
    assert selective_auc(conf, corr) == pytest.approx(np.mean(np.minimum(k, c) / k))


def test_uninformative_confidence_gives_auc_equal_to_accuracy():
    corr = np.array([1, 0, 0, 1, 1, 0, 0, 0], dtype=float)
    # all tied: every coverage has the expected accuracy 3/8
    np.testing.assert_allclose(accuracy_coverage_curve(np.full(8, 0.3), corr)[1], 3 / 8)
    rng = np.random.default_rng(0)
    corr = rng.uniform(size=20000) < 0.3
    assert selective_auc(rng.uniform(size=20000), corr) == pytest.approx(corr.mean(), abs=0.02)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=40))
def test_curve_properties(pairs):
    conf = np.array([p[0] for p in pairs], dtype=float) / 5
    corr = np.array([p[1] for p in pairs], dtype=float)
    _, acc = accuracy_coverage_curve(conf, corr)
    assert acc[-1] == pytest.approx(corr.mean())  # full coverage = plain accuracy
    assert np.all((acc >= -1e-12) & (acc <= 1 + 1e-12))
    perm = np.random.default_rng(len(pairs)).permutation(len(pairs))
    np.testing.assert_allclose(accuracy_coverage_curve(conf[perm], corr[perm])[1], acc)


def test_memorizer_extracts_every_token():
    res = token_by_token_extraction(memorizing_scorer(TEXTS), TEXTS)
    assert res.correct.size == sum(len(t) - 1 for t in TEXTS)
    assert res.acc() == 1.0 and res.auc() == 1.0
    assert res.confidence.min() > 0.99


def test_uniform_scorer_extracts_nothing_and_q_restriction():
    res = token_by_token_extraction(uniform_scorer(), TEXTS, q_scorer=uniform_scorer())
    assert res.acc() == 0.0
    np.testing.assert_allclose(res.confidence, 1 / TOK.vocab_size, rtol=1e-5)
    assert res.q_fails.all()  # q (uniform) fails everywhere: the restriction keeps everything
    assert res.acc(restrict=True) == 0.0
    mem = token_by_token_extraction(
        memorizing_scorer(TEXTS), TEXTS, q_scorer=memorizing_scorer(TEXTS[:1])
    )
    # q memorized only the first text: the restriction keeps exactly the other texts' tokens
    assert mem.q_fails.sum() == sum(len(t) - 1 for t in TEXTS[1:])
    assert mem.acc(restrict=True) == 1.0
    metrics = {r.metric for r in mem.rows(corpus="toy")}
    assert metrics == {"auc", "acc", "auc_q_fails", "acc_q_fails"}


def test_min_prefix_and_max_tokens():
    res = token_by_token_extraction(memorizing_scorer(TEXTS), TEXTS, min_prefix=3, max_tokens=8)
    assert res.correct.size == 3 * (8 - 3)


def test_rows_carry_intervals_over_examples():
    texts = [*TEXTS, "omega psi chi", "rho sigma tau"]
    half = memorizing_scorer(texts[:3])  # memorized 3 of the 5 texts
    res = token_by_token_extraction(half, texts)
    est = res.estimates()
    assert est["acc"].n == 5 and est["acc"].value == pytest.approx(res.acc())
    assert est["auc"].value == pytest.approx(res.auc())
    for e in est.values():
        assert e.ci_low < e.value < e.ci_high  # the examples differ: a real interval
    rows = {r.metric: r.to_dict() for r in res.rows()}
    assert (
        rows["acc"]["ci_low"] == est["acc"].ci_low and rows["auc"]["ci_high"] == est["auc"].ci_high
    )
