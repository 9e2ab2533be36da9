"""Test-wide settings: offline hubs, one BLAS thread per process, a shared model cache."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The converted base model and the tokenizer are cached here across test runs (see scpdr.models).
os.environ.setdefault("SCPDR_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "scpdr"))

import pytest
import torch

# One intra-op thread: the tiny test models gain nothing from two, and OpenMP spin-waiting
# made small multi-row matmuls 4-5x slower whenever the other core was busy (measured).
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny bundle (``make_tiny_bundle``: base and two constituents, no constant base vector),
    one per test module (some tests corrupt or edit it)."""
    from scpdr.testing import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("tiny"), k=2, constant_base=False)
