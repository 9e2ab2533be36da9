"""Utility: next-token accuracy and NLL known answers."""

from __future__ import annotations

import math

import pytest
from attack_doubles import TOK, memorizing_scorer, uniform_scorer

from scpdr.attacks.utility import utility

VAL = ["held out text one", "Another held out line"]


def test_utility_of_uniform_and_memorizer():
    u = utility(uniform_scorer(), VAL)
    assert u.accuracy == 0.0  # argmax is the pad token, never a real target
    assert u.mean_nll == pytest.approx(math.log(TOK.vocab_size), rel=1e-5)
    m = utility(memorizing_scorer(VAL), VAL)
    assert m.accuracy == 1.0
    assert m.mean_nll < 1e-6
    rows = {r.metric: r for r in m.rows(method="none", corpus="toy")}
    assert rows["accuracy"].n == sum(len(v) - 1 for v in VAL)
    assert rows["nll"].extra["stderr"] >= 0


def test_utility_rows_carry_intervals_over_examples():
    texts = ["alpha beta", "gamma delta", "epsilon", "zeta eta"]
    res = utility(memorizing_scorer(texts[:2]), texts)
    rows = {r.metric: r.to_dict() for r in res.rows()}
    for metric in ("accuracy", "nll"):
        d = rows[metric]
        assert d["ci_low"] < d["value"] < d["ci_high"], metric
    assert rows["accuracy"]["value"] == pytest.approx(res.accuracy)
