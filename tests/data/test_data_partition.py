"""Partitions: disjoint, balanced, near-duplicates together (hypothesis); the audit catches planted
exact and near-duplicate overlaps; manifests and directories round-trip."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scpdr.data.canaries import CanaryConfig, make_canaries
from scpdr.data.partition import (
    GroupingConfig,
    PartitionManifest,
    audit_dir,
    audit_partitions,
    group_near_duplicates,
    load_partitions,
    partition_records,
    save_partitions,
    shingles,
)
from scpdr.data.records import DataError, Record
from scpdr.errors import ConfigError, PartitionAuditError

_ALPHA = "abcdefghijklmnopqrstuvwxyz"


def _random_text(rng: random.Random, n_words: int = 40) -> str:
    return " ".join(
        "".join(rng.choice(_ALPHA) for _ in range(rng.randint(3, 9))) for _ in range(n_words)
    )


def _mutate(rng: random.Random, text: str) -> str:
    """A near-duplicate: one word replaced (Jaccard of 5-gram shingles stays > 0.8)."""
    words = text.split()
    words[rng.randrange(len(words))] = "zzzz"
    return " ".join(words)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 30),
    n_dups=st.integers(0, 6),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_partitions_disjoint_balanced_and_near_duplicates_together(
    n: int, n_dups: int, k: int, seed: int
):
    rng = random.Random(seed)
    base = [_random_text(rng) for _ in range(n)]
    texts = list(base)
    planted = []  # (original index, copy index)
    for _ in range(n_dups):
        i = rng.randrange(n)
        texts.append(_mutate(rng, base[i]) if rng.random() < 0.7 else base[i])
        planted.append((i, len(texts) - 1))
    records = [Record.make(id=f"r{i}", text=t) for i, t in enumerate(texts)]
    if len(group_near_duplicates(texts)) < k:  # fewer groups than partitions: refused
        with pytest.raises(DataError, match="would be empty"):
            partition_records(records, k=k, seed=seed)
        return
    pset = partition_records(records, k=k, seed=seed)

    ids = [r.id for part in pset.parts for r in part]
    assert sorted(ids) == sorted(r.id for r in records)  # every record exactly once
    where = {r.id: p for p, part in enumerate(pset.parts) for r in part}
    for i, j in planted:
        assert where[f"r{i}"] == where[f"r{j}"]
    groups = group_near_duplicates(texts)
    for g in groups:
        assert len({where[f"r{i}"] for i in g}) == 1
    sizes = [len(p) for p in pset.parts]
    assert max(sizes) - min(sizes) <= max(len(g) for g in groups)
    # the manifest matches and the audit passes
    m = pset.manifest
    assert [e.ids for e in m.partitions] == [[r.id for r in part] for part in pset.parts]
    assert audit_partitions(m, records).passed
    # deterministic in the seed
    assert partition_records(records, k=k, seed=seed).manifest == m


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=30), min_size=1, max_size=12))
def test_grouping_is_a_partition_of_indices_and_exact_duplicates_group(texts: list[str]):
    groups = group_near_duplicates(texts)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(texts)))
    gid = {i: n for n, g in enumerate(groups) for i in g}
    for i in range(len(texts)):
        for j in range(i):
            if texts[i] == texts[j]:
                assert gid[i] == gid[j]


def test_grouping_threshold_separates_unrelated_texts():
    rng = random.Random(0)
    a, b = _random_text(rng), _random_text(rng)
    assert len(group_near_duplicates([a, b])) == 2
    assert len(group_near_duplicates([a, _mutate(rng, a)])) == 1
    # a low threshold merges more; shingles are case- and whitespace-insensitive
    assert shingles("A  b") == shingles("a b")


def _planted(k: int = 2):
    rng = random.Random(1)
    recs = [Record.make(id=f"r{i}", text=_random_text(rng)) for i in range(20)]
    return recs, partition_records(recs, k=k, seed=0)


def test_audit_catches_planted_exact_overlap():
    recs, pset = _planted()
    m = pset.manifest.model_copy(deep=True)
    victim = m.partitions[0].ids[0]
    src = next(r for r in recs if r.id == victim)
    # (a) the same id listed in a second partition
    m.partitions[1].ids.append(victim)
    m.partitions[1].hashes.append(src.hash)
    rep = audit_partitions(m, recs)
    assert not rep.passed
    assert any(o.id_a == victim == o.id_b for o in rep.exact_overlaps)
    # (b) a different id with identical text in the other partition
    copy = Record.make(id="copy", text=src.text)
    m2 = pset.manifest.model_copy(deep=True)
    m2.partitions[1].ids.append("copy")
    m2.partitions[1].hashes.append(copy.hash)
    rep2 = audit_partitions(m2, [*recs, copy])
    assert [(o.kind, {o.id_a, o.id_b}) for o in rep2.exact_overlaps] == [
        ("exact", {victim, "copy"})
    ]
    assert not rep2.near_duplicate_overlaps
    with pytest.raises(PartitionAuditError, match="1 exact overlaps"):
        rep2.raise_if_failed()


def test_audit_catches_planted_near_duplicate_and_tampering():
    recs, pset = _planted()
    victim = pset.parts[0][3]
    near = Record.make(id="near", text=_mutate(random.Random(7), victim.text))
    m = pset.manifest.model_copy(deep=True)
    m.partitions[1].ids.append("near")
    m.partitions[1].hashes.append(near.hash)
    rep = audit_partitions(m, [*recs, near])
    assert not rep.exact_overlaps
    [o] = rep.near_duplicate_overlaps
    assert {o.id_a, o.id_b} == {victim.id, "near"} and 0.7 <= o.jaccard < 1.0
    assert {o.partition_a, o.partition_b} == {0, 1}
    # a stricter threshold than the pair's similarity passes the near-duplicate check
    assert o.jaccard < 0.95
    strict = GroupingConfig(threshold=0.95, num_perm=256)
    assert audit_partitions(m, [*recs, near], grouping=strict).passed
    with pytest.raises(ConfigError, match="lower the threshold or raise num_perm"):
        audit_partitions(m, recs, grouping=GroupingConfig(threshold=0.99, num_perm=64))
    # a record edited after partitioning is an integrity error
    edited = [Record.make(id=r.id, text=r.text + "!") if r.id == victim.id else r for r in recs]
    rep3 = audit_partitions(pset.manifest, edited)
    assert any("changed since the manifest" in e for e in rep3.integrity_errors)


def test_canaries_pinned_to_their_partition_and_audited(tmp_path: Path):
    rng = random.Random(2)
    recs = [Record.make(id=f"r{i}", text=_random_text(rng)) for i in range(12)]
    reg = make_canaries(CanaryConfig(n_per_repetition=2, repetitions=(1, 3), partition=1))
    held = [Record.make(id=f"v{i}", text=_random_text(rng)) for i in range(2)]
    pset = partition_records(recs, k=3, seed=0, canaries=reg, validation=held)
    texts1 = [r.text for r in pset.parts[1]]
    for c in reg.inserted:
        assert texts1.count(c.text) == c.repetitions
    for p in (0, 2):
        assert not {c.text for c in reg.canaries} & {r.text for r in pset.parts[p]}
    # balance is over the unpinned records
    assert sorted(len([r for r in p if r.id.startswith("r")]) for p in pset.parts) == [4, 4, 4]
    out = save_partitions(tmp_path / "parts", pset)
    assert sorted(x.name for x in out.iterdir()) == [
        "canaries.json",
        "manifest.json",
        "partition-0.jsonl",
        "partition-1.jsonl",
        "partition-2.jsonl",
        "validation.jsonl",
    ]
    back = load_partitions(out)
    assert back.manifest == pset.manifest and back.parts == pset.parts
    assert back.canaries == reg and back.validation == held
    assert audit_dir(out).passed
    assert PartitionManifest.load(out / "manifest.json").sha256() == pset.manifest.sha256()
    # a held-out canary slipped into training fails the audit
    leak = Record.make(id="leak", text=reg.held_out[0].text)
    m = pset.manifest.model_copy(deep=True)
    m.partitions[0].ids.append("leak")
    m.partitions[0].hashes.append(leak.hash)
    rep = audit_partitions(m, [*pset.records(), leak], canaries=reg)
    assert any("held-out canary" in e for e in rep.canary_errors)
    with pytest.raises(DataError, match="already exists"):
        save_partitions(out, pset)


def test_partition_errors():
    recs = [Record.make(id="a", text="x"), Record.make(id="a", text="y")]
    with pytest.raises(DataError, match="duplicate record id 'a'"):
        partition_records(recs, k=2)
    with pytest.raises(DataError, match="k >= 1"):
        partition_records(recs[:1], k=0)
    same = [Record.make(id="a", text="same text"), Record.make(id="b", text="same text")]
    with pytest.raises(DataError, match="pinned to different partitions"):
        partition_records(same, k=2, pins={"a": 0, "b": 1})


def test_partition_refuses_to_leave_a_partition_empty():
    recs = [
        Record.make(id=f"r{i}", text=f"record number {i} about topic {i * 7}") for i in range(3)
    ]
    with pytest.raises(DataError, match=r"partition\(s\) \[3, 4\] would be empty.*lower k"):
        partition_records(recs, k=5)
    # exact duplicates form one group: 2 groups cannot fill 3 partitions
    dup = [Record.make(id=f"d{i}", text="the very same text") for i in range(4)]
    with pytest.raises(DataError, match="would be empty"):
        partition_records([*dup, recs[0]], k=3)
    assert len(partition_records(recs, k=3).parts) == 3
