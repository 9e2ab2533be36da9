"""Shared, read-only inputs of the attack tests: one tiny bundle (base, two constituents, a
constant base vector) and a Names2IDs partition directory with canaries, built once per session.

Tests only read them: a test that changes a bundle copies it first (``shutil.copytree``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def attack_world(tmp_path_factory) -> dict[str, Path]:
    """``{"bundle": DIR, "parts": DIR}``: never write into them."""
    from scpdr.data import (
        CanaryConfig,
        make_canaries,
        names2ids,
        partition_records,
        save_partitions,
    )
    from scpdr.testing import make_tiny_bundle

    root = tmp_path_factory.mktemp("attacks-world")
    corpus = names2ids(n_train=6, n_val=3, seed=0)
    reg = make_canaries(CanaryConfig(n_per_repetition=2, repetitions=(3,), partition=0, seed=0))
    pset = partition_records(
        corpus.train,
        k=2,
        seed=0,
        canaries=reg,
        validation=corpus.validation,
        dataset={"name": "names2ids"},
    )
    return {
        "parts": save_partitions(root / "parts", pset),
        "bundle": make_tiny_bundle(root / "bundle", seed=0),
    }
