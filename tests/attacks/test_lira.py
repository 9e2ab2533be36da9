"""LiRA: ROC known answers and a real run on hand-made target/reference scorers."""

from __future__ import annotations

import numpy as np
import pytest
from attack_doubles import memorizing_scorer, uniform_scorer
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.attacks.lira import lira, plot_roc, roc_auc, roc_curve, tpr_at_fpr

MEMBERS = ["the cat sat on the mat", "Quantum widgets hum at dawn", "seven blue kites"]
NONMEMBERS = ["a dog ran in the park", "Xylophones rarely whisper", "nine green boats"]


def test_perfect_and_reversed_and_random_rankings():
    labels = np.r_[np.ones(50), np.zeros(50)]
    scores = np.r_[np.linspace(2, 3, 50), np.linspace(0, 1, 50)]
    assert roc_auc(scores, labels) == 1.0
    assert roc_auc(-scores, labels) == 0.0
    fpr, tpr = roc_curve(scores, labels)
    assert tpr_at_fpr(fpr, tpr, 0.01) == 1.0
    rng = np.random.default_rng(0)
    big = rng.uniform(size=20000) < 0.5
    assert roc_auc(rng.normal(size=20000), big) == pytest.approx(0.5, abs=0.02)
    assert roc_auc(np.zeros(10), np.r_[np.ones(5), np.zeros(5)]) == 0.5  # all tied


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=40))
def test_auc_is_the_mann_whitney_statistic(pairs):
    s = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs], dtype=bool)
    if y.all() or not y.any():
        return
    diff = s[y][:, None] - s[~y][None, :]
    mw = ((diff > 0) + 0.5 * (diff == 0)).mean()
    assert roc_auc(s, y) == pytest.approx(mw)


def test_tpr_at_low_fpr():
    # non-member scores 0..99; members: 10 above every non-member, the rest below all of them
    s = np.r_[np.arange(100.0), 200 + np.arange(10.0), -1 - np.arange(90.0)]
    y = np.r_[np.zeros(100), np.ones(100)]
    fpr, tpr = roc_curve(s, y)
    assert tpr_at_fpr(fpr, tpr, 0.001) == pytest.approx(0.10)
    assert tpr_at_fpr(fpr, tpr, 0.01) == pytest.approx(0.10)  # 1 false positive adds nothing


def test_lira_separates_members_of_a_memorizer(tmp_path):
    res = lira(memorizing_scorer(MEMBERS), uniform_scorer(), MEMBERS, NONMEMBERS)
    assert res.auc == 1.0
    assert res.tpr_at(0.01) == 1.0
    rows = {r.metric: r for r in res.rows(method="none", corpus="toy")}
    assert set(rows) == {"auc", "tpr@0.01fpr", "tpr@0.001fpr"}
    assert rows["auc"].extra["n_members"] == 3
    # a target that is the reference: no signal at all
    null = lira(uniform_scorer(), uniform_scorer(), MEMBERS, NONMEMBERS)
    assert null.auc == 0.5
    out = plot_roc({"none": res, "null": null}, tmp_path / "roc.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_reference_scores_are_cached_across_targets():
    ref = uniform_scorer()
    calls = []
    inner = ref.score
    ref.score = lambda *a, **k: calls.append(1) or inner(*a, **k)
    cache: dict = {}
    a = lira(memorizing_scorer(MEMBERS), ref, MEMBERS, NONMEMBERS, cache=cache, batch_size=8)
    n_first = len(calls)
    b = lira(uniform_scorer(), ref, MEMBERS, NONMEMBERS, cache=cache, batch_size=8)
    assert len(calls) == n_first > 0  # the second target reused the reference's scores
    assert a.auc == 1.0 and b.auc == 0.5
