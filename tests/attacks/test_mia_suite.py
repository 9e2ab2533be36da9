"""The MIA suite end to end on hand-made scorers whose answers are known: a model that memorized
the members exactly, a uniform model (knows nothing), a model that memorized the non-members (a
flipped test); and where its members and non-members come from (EvalData.mia_population)."""

from __future__ import annotations

import numpy as np
import pytest
from attack_doubles import memorizing_scorer, uniform_scorer

from scpdr.attacks.eval_data import EvalData
from scpdr.attacks.exposure import CanarySpace
from scpdr.attacks.mia import MIA_ATTACKS, MIA_METRICS, auc_distance, membership_inference

# distinct first characters: the memorizer's table never confuses two texts
MEMBERS = [f"{c} member text, some words" for c in "abcdefghij"]
NONMEMBERS = [f"{c} other text, more words" for c in "klmnopqrst"]


def _auc(res, attack):
    return res.scores.metrics(attack, n_boot=50).auc.value


def test_a_memorizer_is_caught_by_every_attack():
    target = memorizing_scorer(MEMBERS)
    res = membership_inference(
        target, MEMBERS, NONMEMBERS, base=uniform_scorer(), reference=uniform_scorer()
    )
    assert res.scores.attacks() == list(MIA_ATTACKS)
    for attack in MIA_ATTACKS:
        assert _auc(res, attack) == 1.0, attack
    rows = res.rows(method="none", corpus="toy")
    assert {(r.attack, r.metric) for r in rows} == {
        (a, m) for a in MIA_ATTACKS for m in MIA_METRICS
    }
    for r in rows:
        d = r.to_dict()
        assert d["n_members"] == 10 and d["n_nonmembers"] == 10 and d["population"] == "records"
        assert d["ci_low"] <= d["value"] <= d["ci_high"]
    curves = res.curves()
    assert set(curves) == set(MIA_ATTACKS) and curves["loss"]["auc"] == 1.0


def test_a_model_without_memory_is_at_chance_and_ratios_cancel():
    # the target is its own reference: every log ratio is exactly 0 -> all tied, AUC .5; the
    # reference-free scores of a uniform model are constant (zlib alone varies with the text)
    u = uniform_scorer()
    res = membership_inference(u, MEMBERS, NONMEMBERS, base=u, reference=u)
    for attack in MIA_ATTACKS:
        if attack != "zlib":
            assert _auc(res, attack) == 0.5, attack
    np.testing.assert_allclose(res.scores.members["ref"], 0.0, atol=1e-9)


def test_a_flipped_test_is_as_far_from_chance_as_its_mirror():
    # the target memorized the NON-members: members look less likely -> AUC 0 (leakage all
    # the same; the report ranks |AUC - .5|)
    res = membership_inference(memorizing_scorer(NONMEMBERS), MEMBERS, NONMEMBERS)
    assert _auc(res, "loss") == 0.0
    assert auc_distance(_auc(res, "loss")) == auc_distance(1.0) == 0.5
    assert "ref" not in res.scores.attacks()  # no base model given: no ref attack


def test_lira_uses_only_the_members_its_reference_never_saw():
    target = memorizing_scorer(MEMBERS)
    res = membership_inference(
        target, MEMBERS, NONMEMBERS, reference=uniform_scorer(), lira_members=MEMBERS[:4]
    )
    assert len(res.scores.members["lira"]) == 4 and len(res.scores.members["loss"]) == 10
    assert len(res.scores.nonmembers["lira"]) == 10


def test_the_reference_scores_are_computed_once_per_scorer():
    base = uniform_scorer()
    calls = []
    inner = base.score
    base.score = lambda *a, **k: calls.append(1) or inner(*a, **k)
    cache: dict = {}
    for target in (memorizing_scorer(MEMBERS), uniform_scorer()):
        membership_inference(target, MEMBERS, NONMEMBERS, base=base, cache=cache, batch_size=32)
    assert len(calls) == 1


def test_the_canary_population_and_its_null():
    space = CanarySpace(tuple(f"w{i}" for i in range(50)), n_words=2)
    mem = [("Secret:", f" w{i} w{i + 1}") for i in range(0, 20, 2)]
    non = [("Secret:", f" w{i} w{i + 2}") for i in range(20, 40, 2)]
    data = EvalData(member_canaries=mem, nonmember_canaries=non, member_space=space)
    pop = data.mia_population()
    assert pop.name == "canaries" and pop.members == mem and pop.nonmembers == non
    assert pop.lira_members is None  # p0 never saw a canary: LiRA uses every member
    assert 0 < len(pop.null) <= len(mem)
    assert all(p == "Secret:" and r.count(" ") == 2 for p, r in pop.null)
    assert not {r for _, r in pop.null} & {r for _, r in (*mem, *non)}
    assert data.mia_population(n=3).members == data.mia_population(n=3).members
    assert len(data.mia_population(n=3).nonmembers) == 3
    # the records population of the same data: none (no training texts)
    assert data.mia_population("records") is None


def test_the_records_population():
    data = EvalData(train=MEMBERS, validation=NONMEMBERS)
    pop = data.mia_population(n=4)
    assert pop.name == "records" and len(pop.members) == len(pop.nonmembers) == 4
    assert set(pop.members) <= set(MEMBERS) and set(pop.nonmembers) <= set(NONMEMBERS)
    # the null: validation texts not drawn as non-members
    assert len(pop.null) == 4 and not set(pop.null) & set(pop.nonmembers)
    with pytest.raises(Exception, match="unknown MIA population"):
        data.mia_population("names")
