"""LiRA: ROC known answers and a real run on hand-made target/reference scorers."""

from __future__ import annotations

import numpy as np
import pytest
from attack_doubles import memorizing_scorer, uniform_scorer
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.attacks.lira import LiRAResult, lira, plot_roc
from scpdr.data.records import Record
from scpdr.errors import ConfigError

MEMBERS = ["the cat sat on the mat", "Quantum widgets hum at dawn", "seven blue kites"]
NONMEMBERS = ["a dog ran in the park", "Xylophones rarely whisper", "nine green boats"]


def _result(member_scores, nonmember_scores):
    s = np.r_[member_scores, nonmember_scores].astype(float)
    y = np.r_[np.ones(len(member_scores), bool), np.zeros(len(nonmember_scores), bool)]
    return LiRAResult(s, y)


def test_perfect_reversed_and_random_rankings():
    scores = np.linspace(2, 3, 50), np.linspace(0, 1, 50)
    assert _result(*scores).auc == 1.0
    assert _result(-scores[0], -scores[1]).auc == 0.0
    assert _result(*scores).tpr_at(0.01) == 1.0
    rng = np.random.default_rng(0)
    assert _result(rng.normal(size=5000), rng.normal(size=5000)).auc == pytest.approx(0.5, abs=0.03)
    assert _result(np.zeros(5), np.zeros(5)).auc == 0.5  # all tied


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=40))
def test_auc_is_the_mann_whitney_statistic(pairs):
    s = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs], dtype=bool)
    if y.all() or not y.any():
        return
    diff = s[y][:, None] - s[~y][None, :]
    mw = ((diff > 0) + 0.5 * (diff == 0)).mean()
    assert LiRAResult(s, y).auc == pytest.approx(mw)


def test_tpr_at_low_fpr_and_the_rows_carry_intervals():
    # non-member scores 0..99; members: 10 above every non-member, the rest below all of them
    res = _result(np.r_[200 + np.arange(10.0), -1 - np.arange(90.0)], np.arange(100.0))
    assert res.tpr_at(0.001) == pytest.approx(0.10)
    assert res.tpr_at(0.01) == pytest.approx(0.10)  # 1 false positive adds nothing
    for r in res.rows(method="none"):
        d = r.to_dict()
        assert d["ci_low"] <= d["value"] <= d["ci_high"]
        assert d["n_members"] == 100 and d["n_nonmembers"] == 100


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


LOG_V = float(np.log(97.0))  # a memorized character under the memorizer vs the uniform model


def test_default_statistic_is_the_log_likelihood_ratio():
    # Every token after the first of a member is memorized: log r1 - log r0 = log 97 each, so
    # the ratio of the sequence likelihoods is (len - 1) * log 97 (the paper's r1(y|x)/r0(y|x)
    # by the chain rule); a per-token mean would give log 97 for every member.
    res = lira(memorizing_scorer(MEMBERS), uniform_scorer(), MEMBERS, NONMEMBERS)
    want = [(len(t) - 1) * LOG_V for t in MEMBERS] + [0.0] * len(NONMEMBERS)
    np.testing.assert_allclose(res.scores, want, atol=1e-4)
    mean = lira(memorizing_scorer(MEMBERS), uniform_scorer(), MEMBERS, NONMEMBERS, statistic="mean")
    np.testing.assert_allclose(mean.scores[:3], LOG_V, atol=1e-4)


def test_sum_and_mean_rank_examples_of_different_lengths_differently():
    # member: 3 of its 5 scored tokens memorized; non-member: 6 of its 39. The likelihood ratio
    # (sum) is larger for the non-member, the per-token mean for the member.
    member, non = "abcdef", "Zyxwvu" + "q" * 34
    target = memorizing_scorer(["abcd", non[:7]])
    assert lira(target, uniform_scorer(), [member], [non]).auc == 0.0
    assert lira(target, uniform_scorer(), [member], [non], statistic="mean").auc == 1.0


PROMPTED_M = [("Name: Ann Lee, ID:", " 0123456789"), ("Name: Bo Chan, ID:", " 5555012345")]
PROMPTED_N = [("Name: Cy Dorr, ID:", " 9876543210"), ("Name: Di Ek, ID:", " 1112223334")]


def test_prompted_examples_score_only_the_response_given_the_prompt():
    # The adversary holds the prompt x; LiRA's ratio is r1(y|x) / r0(y|x) over the response y.
    # A target that memorized the members' prompts (names) but not their IDs carries no signal
    # about y: scoring the whole text would give AUC 1 from the name tokens alone.
    names_only = memorizing_scorer([p for p, _ in PROMPTED_M])
    res = lira(names_only, uniform_scorer(), PROMPTED_M, PROMPTED_N)
    np.testing.assert_allclose(res.scores, 0.0, atol=1e-4)
    assert res.auc == 0.5
    whole = lira(names_only, uniform_scorer(), [p + r for p, r in PROMPTED_M], PROMPTED_N)
    assert whole.auc == 1.0
    # A target that memorized the whole member texts: exactly len(response) * log 97 each.
    full = memorizing_scorer([p + r for p, r in PROMPTED_M])
    res = lira(full, uniform_scorer(), PROMPTED_M, PROMPTED_N)
    np.testing.assert_allclose(res.scores, [11 * LOG_V, 11 * LOG_V, 0.0, 0.0], atol=1e-4)
    # records (prompt/response/text) are scored the same way as the pairs
    recs = [Record.make(id=f"m{i}", prompt=p, response=r) for i, (p, r) in enumerate(PROMPTED_M)]
    recs_n = [Record.make(id=f"n{i}", prompt=p, response=r) for i, (p, r) in enumerate(PROMPTED_N)]
    np.testing.assert_allclose(
        lira(full, uniform_scorer(), recs, recs_n).scores, res.scores, atol=1e-6
    )
    # text-only records are scored whole, like their text
    text_only = [Record.make(id="t", text=MEMBERS[0])]
    np.testing.assert_allclose(
        lira(memorizing_scorer(MEMBERS), uniform_scorer(), text_only, NONMEMBERS[:1]).scores,
        [(len(MEMBERS[0]) - 1) * LOG_V, 0.0],
        atol=1e-4,
    )


def test_examples_with_nothing_to_score_are_refused():
    with pytest.raises(ConfigError, match="non-member 0 has no token to score"):
        lira(uniform_scorer(), uniform_scorer(), PROMPTED_M, [("Name: X, ID:", "")])
    with pytest.raises(ConfigError, match=r"^LiRA member 0 has no token to score.*max_tokens=10"):
        lira(uniform_scorer(), uniform_scorer(), PROMPTED_M, PROMPTED_N, max_tokens=10)
    with pytest.raises(ConfigError, match="member 0 is a float"):
        lira(uniform_scorer(), uniform_scorer(), [1.5], NONMEMBERS)


def test_reference_cache_is_not_fooled_by_a_reused_object_id():
    # References created and dropped in turn often get the same id(); a cache keyed on the id
    # alone served the uniform reference's scores to the memorizing one (and back).
    target = memorizing_scorer(MEMBERS)
    cache: dict = {}
    for k in range(10):
        ref = memorizing_scorer(MEMBERS, name="ref") if k % 2 else uniform_scorer()
        cached = lira(target, ref, MEMBERS, NONMEMBERS, cache=cache).scores
        fresh = lira(target, ref, MEMBERS, NONMEMBERS).scores
        np.testing.assert_array_equal(cached, fresh)
        del ref
