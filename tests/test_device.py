"""scpdr.device: the one --device spelling (train, eval, serve, the experiment's device:)."""

from __future__ import annotations

import pytest
import torch

from scpdr.device import (
    check_device,
    cuda_index,
    device_source,
    is_cuda,
    model_dtype,
    resolve_device,
)
from scpdr.errors import ConfigError


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", " CUDA:1 "])
def test_device_spellings_accepted(name):
    assert check_device(name) == name.strip().lower()


@pytest.mark.parametrize("name", ["gpu", "tpu", "cuda:", "cuda:x", "cpu:0", "mps"])
def test_other_spellings_are_errors_naming_the_option(name):
    with pytest.raises(ConfigError, match=r"--dev .*: must be cpu, cuda or cuda:N"):
        check_device(name, option="--dev")


def test_cuda_helpers():
    assert cuda_index("cuda:3") == 3 and cuda_index("cuda") is None and cuda_index("cpu") is None
    assert is_cuda("cuda:1") and is_cuda(torch.device("cuda")) and not is_cuda("cpu")
    assert model_dtype("cuda:0") is torch.bfloat16 and model_dtype("cpu") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_without_cuda_the_default_is_cpu_and_cuda_is_an_error(monkeypatch):
    monkeypatch.delenv("SCPDR_DEVICE", raising=False)
    assert resolve_device(None) == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"no CUDA device .* use --device cpu"):
        resolve_device("cuda:0")


def test_scpdr_device_is_the_default_and_an_explicit_device_wins(monkeypatch):
    monkeypatch.setenv("SCPDR_DEVICE", " CPU ")
    assert resolve_device(None) == "cpu"
    monkeypatch.setenv("SCPDR_DEVICE", "gpu")
    with pytest.raises(ConfigError, match=r"SCPDR_DEVICE 'gpu': must be cpu, cuda or cuda:N"):
        resolve_device(None)
    assert resolve_device("cpu") == "cpu"  # not read when a device is given
    monkeypatch.setenv("SCPDR_DEVICE", f"cuda:{torch.cuda.device_count()}")  # never there
    with pytest.raises(ConfigError, match=r"SCPDR_DEVICE cuda:\d+: (no CUDA|torch sees)"):
        resolve_device(None)
    monkeypatch.setenv("SCPDR_DEVICE", "")  # empty: as if unset
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    # where a device came from, for messages
    assert device_source(None) == (None, "the default device")
    assert device_source("cpu", option="device:") == ("cpu", "device:")
    monkeypatch.setenv("SCPDR_DEVICE", "cuda:1")
    assert device_source(None) == ("cuda:1", "SCPDR_DEVICE")


def test_serve_uses_the_same_resolver():
    from scpdr.serve import server

    assert server.resolve_device is resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_eval_device_is_checked_before_any_work(tiny_bundle, tmp_path, capsys):
    from scpdr.cli import main

    out = tmp_path / "eval"
    assert main(["eval", str(tiny_bundle), "--out", str(out), "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err
    assert main(["eval", str(tiny_bundle), "--out", str(out), "--device", "npu"]) == 2
    assert "must be cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not out.exists()


def test_scorers_on_an_explicit_cpu_equal_the_default(tiny_bundle):
    from scpdr.attacks.bundle_scorers import load_scorers

    default = load_scorers(tiny_bundle, ["cp-delta"])
    cpu = load_scorers(tiny_bundle, ["cp-delta"], device="cpu")
    assert cpu.device == "cpu" and default.device == resolve_device(None)
    enc = cpu.tokenizer(["Name: Ada Lovelace, ID: 1815"], return_tensors="pt")
    a = default["cp-delta"].score(enc["input_ids"], enc["attention_mask"])
    b = cpu["cp-delta"].score(enc["input_ids"], enc["attention_mask"])
    if not torch.cuda.is_available():
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_protected_lm_loads_where_it_is_told(tiny_bundle):
    """ProtectedLM.from_bundle: the default device is cuda when available (here: cpu); CUDA asked
    for and missing is the one device error, before any model loads."""
    from scpdr import ProtectedLM

    lm = ProtectedLM.from_bundle(tiny_bundle, method="cp-delta")
    assert lm.device == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        ProtectedLM.from_bundle(tiny_bundle, method="cp-delta", device="cuda")
    with pytest.raises(ConfigError, match="must be cpu, cuda or cuda:N"):
        ProtectedLM.from_bundle(tiny_bundle, method="cp-delta", device="mps")
