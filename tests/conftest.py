"""Test-wide settings (offline hubs, one BLAS thread per process, a shared model cache) and the
session's shared, read-only tiny bundle."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Training precision: `auto` would measure bf16 against fp32 on the machine (and pick either);
# the tests train in fp32 everywhere, and those of `auto` unset this or inject flags and timings.
os.environ["SCPDR_PRECISION"] = "fp32"
os.environ["SCPDR_DECODE_PRECISION"] = "fp32"  # serve's --precision auto on CPU, likewise
# The default device: the CPU tests compare with CPU references, also on a machine with a GPU
# (where the library's default is cuda; tests/gpu clears this to test that default).
os.environ["SCPDR_DEVICE"] = "cpu"
# The converted base model and the tokenizer are cached here across test runs (see scpdr.models).
os.environ.setdefault("SCPDR_HOME", str(Path(__file__).resolve().parents[1] / ".cache" / "scpdr"))

import pytest
import torch

# One intra-op thread: the tiny test models gain nothing from two, and OpenMP spin-waiting
# made small multi-row matmuls 4-5x slower whenever the other core was busy (measured).
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors and models run faster on one thread: on a shared 2-core machine OpenMP
    hand-offs stall every small op. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """THE tiny bundle of the test session (``make_tiny_bundle(k=2, constant_base=False)``: a
    random base and two constituents, no constant base vector), built once. Read-only: its files
    are made unwritable; a test that changes a bundle uses ``tiny`` (a copy) instead."""
    from scpdr.testing import make_tiny_bundle

    root = make_tiny_bundle(tmp_path_factory.mktemp("tiny-bundle"), k=2, constant_base=False)
    for f in root.rglob("*"):
        if f.is_file():
            f.chmod(0o444)
    return root


@pytest.fixture(scope="module")
def tiny(tiny_bundle, tmp_path_factory) -> Path:
    """A writable copy of :func:`tiny_bundle`, one per test module (some tests corrupt or edit
    it): copy on write, without building the models again."""
    dst = tmp_path_factory.mktemp("tiny") / "bundle"
    return Path(shutil.copytree(tiny_bundle, dst, copy_function=shutil.copyfile))
