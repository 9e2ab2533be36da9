"""Canaries: word list, counts per repetition, held-out baseline, registry round trip."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.data.canaries import (
    CANARY_PREFIX,
    CanaryConfig,
    CanaryRegistry,
    build_wordlist,
    load_wordlist,
    make_canaries,
)


def test_wordlist_resource_matches_its_documented_source():
    words = load_wordlist()
    assert len(words) >= 5000
    assert words == sorted(set(words))
    assert words == build_wordlist()  # the shipped file is exactly what its source derives


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    reps=st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True),
    k=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
def test_canary_counts_per_repetition(n: int, reps: list[int], k: int, seed: int):
    cfg = CanaryConfig(n_per_repetition=n, repetitions=tuple(reps), num_words=k, seed=seed)
    reg = make_canaries(cfg)
    assert len(reg.inserted) == len(reg.held_out) == n * len(reps)
    by = reg.by_repetition()
    for r in reps:
        assert len(by[r]) == n
    assert len(by[0]) == n * len(reps)
    copies = Counter(rec.text for rec in reg.records())
    assert len(reg.records()) == n * sum(reps)
    for c in reg.inserted:
        assert copies[c.text] == c.repetitions
        assert c.text == f"{CANARY_PREFIX} {' '.join(c.words)}" and len(c.words) == k
    assert not {c.text for c in reg.held_out} & set(copies)
    assert len({c.words for c in reg.canaries}) == len(reg.canaries)  # all distinct
    assert set(reg.pins().values()) == {cfg.partition}


def test_registry_round_trip_and_determinism(tmp_path: Path):
    reg = make_canaries(CanaryConfig(n_per_repetition=2, partition=1, seed=5))
    assert make_canaries(CanaryConfig(n_per_repetition=2, partition=1, seed=5)) == reg
    back = CanaryRegistry.load(reg.save(tmp_path / "canaries.json"))
    assert back == reg
    assert back.records() == reg.records() and back.partition == 1
