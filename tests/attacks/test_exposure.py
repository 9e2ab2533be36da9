"""Canary exposure: known answers on hand-made scorers (uniform, memorizer, random bigram)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from attack_doubles import bigram_scorer, memorizing_scorer, uniform_scorer

from scpdr.attacks.exposure import (
    Canary,
    CanarySpace,
    canary_exposure,
    exposure_rows,
    extrapolated_exposure,
    random_canaries,
    rank_exposure,
)
from scpdr.errors import ConfigError

WORDS = tuple("ant bee cat dog eel fox gnu hen jay owl pig rat yak elk emu ape".split())
# equal-length words: a per-token uniform model is then uniform over candidates
SPACE = CanarySpace(WORDS, n_words=3)  # 16^3 = 4096 candidates: enumerable
PREFIX = "The secret words are:"


def test_rank_exposure_closed_form():
    all_l = np.arange(1, 1025, dtype=float)  # L = 1..1024, distinct
    # the most likely candidate: rank 1 -> log2 |R|; the least likely: rank |R| -> 0
    assert rank_exposure(1.0, all_l)[0] == pytest.approx(10.0)
    assert rank_exposure(1024.0, all_l)[0] == pytest.approx(0.0)
    assert rank_exposure(4.0, all_l)[0] == pytest.approx(10.0 - 2.0)
    # ties count against the attacker
    assert rank_exposure(3.0, np.full(8, 3.0))[0] == pytest.approx(0.0)


def test_uniform_scorer_has_zero_exposure_exact_and_extrapolated():
    space = CanarySpace(WORDS[:8], n_words=3)
    canaries = random_canaries(space, PREFIX, 5, seed=1)
    exact = canary_exposure(uniform_scorer(), canaries, space, batch_size=128)
    assert exact.mode == "exact"
    np.testing.assert_allclose(exact.exposure, 0.0, atol=1e-9)
    extra = canary_exposure(uniform_scorer(), canaries, space, enumerate_limit=0, n_reference=200)
    assert extra.mode == "extrapolated"
    np.testing.assert_allclose(extra.exposure, 0.0, atol=1e-9)


def test_memorized_canary_has_maximal_exposure():
    space = CanarySpace(WORDS[:8], n_words=3)  # 512 candidates
    secret = ("cat", "eel", "hen")
    scorer = memorizing_scorer([PREFIX + space.render(secret)])
    others = [Canary(PREFIX, ("dog", "ant", "bee"), 0), Canary(PREFIX, ("cat", "ant", "bee"), 0)]
    res = canary_exposure(scorer, [Canary(PREFIX, secret, 3), *others], space)
    assert res.exposure[0] == pytest.approx(space.log2_size)  # rank 1 of 512 -> 9 bits
    # "dog ...": tied with every candidate not starting with "cat" -> rank 512 -> 0 bits
    assert res.exposure[1] == pytest.approx(0.0, abs=1e-9)
    # "cat ant ...": behind the 8 "cat eel *", tied with the 56 other "cat *" -> rank 64 -> 3 bits
    assert res.exposure[2] == pytest.approx(3.0, abs=1e-9)
    ext = canary_exposure(
        scorer, [Canary(PREFIX, secret, 3)], space, enumerate_limit=0, n_reference=200
    )
    assert ext.exposure[0] == pytest.approx(space.log2_size)  # far tail: clipped at log2|R|


def test_exact_and_extrapolated_exposure_agree_on_an_enumerable_space():
    scorer = bigram_scorer(seed=3, scale=1.0)
    exact = canary_exposure(scorer, random_canaries(SPACE, PREFIX, 1), SPACE, batch_size=256)
    all_l = exact.reference_logppl[PREFIX]
    # canaries at chosen quantiles of the true distribution (1/2 down to 1/256 of the space)
    order = np.argsort(all_l)
    idx = SPACE.all_indices()
    canaries = []
    for q in (2.0**-1, 2.0**-3, 2.0**-5, 2.0**-8):
        row = idx[order[int(q * SPACE.size) - 1]]
        canaries.append(Canary(PREFIX, tuple(WORDS[i] for i in row), 1))
    flat = [np.ravel_multi_index(SPACE.index(c.secret), (len(WORDS),) * 3) for c in canaries]
    exact_e = rank_exposure(all_l[flat], all_l)
    np.testing.assert_allclose(exact_e, [1, 3, 5, 8], atol=0.1)  # by construction (up to ties)
    fit = canary_exposure(
        scorer, canaries, SPACE, enumerate_limit=0, n_reference=2000, seed=0, batch_size=256
    )
    assert fit.mode == "extrapolated"
    assert np.abs(fit.exposure - exact_e).max() < 0.5


def test_random_canary_baseline_is_chance():
    # under a model that knows nothing about them, exposure = -log2 U with U ~ Uniform(0, 1):
    # mean log2(e) = 1.44 bits, 95th percentile log2(20) = 4.32 bits
    scorer = bigram_scorer(seed=4, scale=1.0)
    canaries = random_canaries(SPACE, PREFIX, 400, seed=5)
    res = canary_exposure(scorer, canaries, SPACE, batch_size=256)
    assert res.exposure.mean() == pytest.approx(math.log2(math.e), abs=0.3)
    assert np.percentile(res.exposure, 95) == pytest.approx(math.log2(20), abs=0.8)


def test_exposure_rows_flag_within_two_std_of_baseline():
    rng = np.random.default_rng(0)
    base = -np.log2(rng.uniform(size=200))
    chance = -np.log2(rng.uniform(size=50))
    high = chance + 10.0
    exp = np.r_[base, chance, high]
    rep = np.r_[np.zeros(200), np.ones(50), np.full(50, 3)].astype(int)
    rows = {(r.metric, r.extra.get("repetitions")): r for r in exposure_rows(exp, rep, method="m")}
    assert rows[("baseline_exposure_mean", None)].extra["baseline"] is True
    assert rows[("exposure_mean", 3)].extra["within_2std_of_baseline"] is False
    assert rows[("exposure_mean", 1)].extra["within_2std_of_baseline"] is True  # chance level
    assert rows[("exposure_mean", 3)].value == pytest.approx(high.mean())
    assert rows[("exposure_p95", 3)].value == pytest.approx(np.percentile(high, 95))
    assert rows[("exposure_mean", 1)].n == 50
    # std / sqrt(n) is the standard error for the mean and the percentile alike
    p95 = rows[("exposure_p95", 1)]
    assert p95.std / np.sqrt(p95.n) == pytest.approx(p95.extra["stderr"])
    d = rows[("exposure_mean", 1)].to_dict()
    assert d["attack"] == "canary" and d["repetitions"] == 1
    assert d["baseline_value"] == pytest.approx(base.mean())


def test_extrapolation_recovers_a_known_tail():
    # log-perplexities ~ N(0, 1): exposure of L = -2.326 is -log2 Phi(-2.326) = -log2 0.01 = 6.64
    ref = np.random.default_rng(0).standard_normal(20_000)
    e = extrapolated_exposure(-2.326, ref, log2_space=40.0)[0]
    assert e == pytest.approx(-math.log2(0.01), abs=0.3)


def test_canary_word_outside_the_space_is_a_clear_error():
    with pytest.raises(ConfigError, match="not in the candidate word list"):
        canary_exposure(uniform_scorer(), [Canary(PREFIX, ("zebra", "ant", "bee"), 1)], SPACE)
