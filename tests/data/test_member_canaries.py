"""Membership canaries (the MIA suite's members and non-members): drawn apart from the exposure
canaries, packed into training records, saved and loaded, and pinned to the canary partition."""

from __future__ import annotations

from scpdr.data import CanaryConfig, make_canaries, names2ids, partition_records
from scpdr.data.canaries import MEMBER_PREFIX, CanaryRegistry


def test_members_are_packed_and_round_trip(tmp_path):
    cfg = CanaryConfig(n_per_repetition=2, repetitions=(3,), members=7, member_pack=3, seed=1)
    reg = make_canaries(cfg)
    plain = make_canaries(cfg.model_copy(update={"members": 0}))
    assert reg.canaries == plain.canaries  # the exposure canaries do not depend on members
    assert len(reg.members) == len(reg.nonmembers) == 7
    assert all(c.prompt == MEMBER_PREFIX and len(c.words) == 2 for c in reg.members)
    texts = {c.text for c in (*reg.members, *reg.nonmembers, *reg.canaries)}
    assert len(texts) == 7 + 7 + 4  # all distinct
    recs = reg.records()
    packed = [r for r in recs if r.id.startswith("canary-members-")]
    assert [len(r.text.split("\n")) for r in packed] == [3, 3, 1]
    assert [line for r in packed for line in r.text.split("\n")] == [c.text for c in reg.members]
    assert len(recs) == 2 * 3 + 3
    back = CanaryRegistry.load(reg.save(tmp_path / "canaries.json"))
    assert back == reg


def test_packed_members_go_to_the_canary_partition():
    corpus = names2ids(n_train=8, n_val=2, seed=0)
    reg = make_canaries(
        CanaryConfig(n_per_repetition=1, repetitions=(1,), members=4, member_pack=2)
    )
    pset = partition_records(corpus.train, k=2, seed=0, canaries=reg, validation=corpus.validation)
    ids = {r.id for r in pset.parts[reg.partition]}
    assert {r.id for r in reg.records()} <= ids
    assert not {r.id for r in reg.records()} & {r.id for r in pset.parts[1]}


def test_the_evaluation_data_reads_the_membership_canaries(tmp_path):
    from scpdr.attacks.eval_data import EvalData
    from scpdr.data import save_partitions

    corpus = names2ids(n_train=8, n_val=2, seed=0)
    reg = make_canaries(
        CanaryConfig(n_per_repetition=1, repetitions=(2,), members=5, member_pack=2)
    )
    pset = partition_records(
        corpus.train,
        k=2,
        seed=0,
        canaries=reg,
        validation=corpus.validation,
        dataset={"name": "names2ids"},
    )
    data = EvalData.from_partitions(save_partitions(tmp_path / "parts", pset))
    assert data.member_canaries == [(c.prompt, c.response) for c in reg.members]
    assert data.nonmember_canaries == [(c.prompt, c.response) for c in reg.nonmembers]
    assert data.member_space is not None and data.member_space.n_words == 2
    assert not any(t.startswith(MEMBER_PREFIX) for t in data.train)  # packed records left out
    pop = data.mia_population()
    assert pop.name == "canaries" and len(pop.members) == 5 and len(pop.null) == 5
