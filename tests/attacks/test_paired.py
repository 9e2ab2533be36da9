"""scpdr.attacks.paired: McNemar's exact test and the paired bootstrap, against hand-computed
answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scpdr.attacks.paired import mcnemar_exact, paired_bootstrap


def test_mcnemar_exact_is_the_binomial_test_of_the_discordant_pairs():
    # 10 pairs: 6 where only a succeeded, 1 where only b did, 2 both, 1 neither
    a = [1, 1, 1, 1, 1, 1, 0, 1, 1, 0]
    b = [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    t = mcnemar_exact(a, b)
    assert (t.a_only, t.b_only, t.n) == (6, 1, 10)
    assert t.difference == pytest.approx(0.5)  # 8/10 - 3/10
    # by hand: two-sided P(X <= 1 or X >= 6), X ~ Bin(7, 1/2) = 2 * (1 + 7) / 2^7
    assert t.p_value == pytest.approx(16 / 128)
    assert not t.significant and t.ci_low < 0 < t.ci_high  # 7 discordant pairs are too few
    assert t.extra()["test"] == "mcnemar-exact"


def test_mcnemar_exact_all_discordant_one_way():
    t = mcnemar_exact([True] * 8, [False] * 8)
    assert t.p_value == pytest.approx(2 / 2**8) and t.significant
    assert t.difference == 1.0 and 0 < t.ci_low < 1.0 and t.ci_high == pytest.approx(1.0)
    # concordant pairs carry no evidence: adding 90 pairs where both succeed keeps p
    t2 = mcnemar_exact([True] * 98, [False] * 8 + [True] * 90)
    assert t2.p_value == pytest.approx(t.p_value) and t2.difference == pytest.approx(8 / 98)
    assert 0 < t2.ci_low < t2.difference and t2.ci_high == pytest.approx(8 / 98)


def test_mcnemar_exact_without_discordant_pairs_is_no_difference():
    t = mcnemar_exact([1, 0, 1], [1, 0, 1])
    assert (t.difference, t.ci_low, t.ci_high, t.p_value) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="same order"):
        mcnemar_exact([1, 0], [1])


def test_paired_bootstrap_uses_the_pairs():
    rng = np.random.default_rng(0)
    b = rng.uniform(0, 1, 40)  # a wide spread between examples ...
    a = b + 0.1  # ... and a constant difference within each pair
    t = paired_bootstrap(a, b, seed=0)
    assert t.difference == pytest.approx(0.1)
    assert t.ci_low == pytest.approx(0.1) and t.ci_high == pytest.approx(0.1)
    assert t.p_value == 0.0 and t.significant and t.n == 40


def test_paired_bootstrap_hand_example():
    # differences 0.1, 0, 0.8, 0: mean 0.225; some resamples draw only the zeros
    t = paired_bootstrap([1.0, 0.0, 1.0, 0.5], [0.9, 0.0, 0.2, 0.5], seed=0, n_boot=2000)
    assert t.difference == pytest.approx(0.225)
    assert t.ci_low == pytest.approx(0.0) and t.ci_high <= 0.8 + 1e-12
    # P(all four draws from the two zero differences) = (1/2)^4: p >= 2 * 1/16 up to noise
    assert t.p_value == pytest.approx(2 / 16, abs=0.04) and not t.significant
    same = paired_bootstrap([0.3, 0.4], [0.3, 0.4])
    assert same.difference == 0.0 and same.p_value == 1.0
    assert math.isnan(paired_bootstrap([], []).difference)
