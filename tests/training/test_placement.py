"""Training across processes and devices: ``accelerate launch --num_processes 2 --cpu -m scpdr
train`` (DDP on gloo) writes the bundle a single process writes, only the main process writing;
an 8-bit optimizer falls back where it cannot run; LoRA with gradient checkpointing trains."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scpdr.data import names2ids
from scpdr.errors import ConfigError
from scpdr.training import TRAIN_INFO, TrainConfig, finetune
from scpdr.training.placement import (
    FALLBACK_OPTIM,
    plain_optim,
    resolve_optim,
    same_update,
    training_device,
)

_FAST = dict(learning_rate=1e-2, batch_size=4, seq_len=32, warmup_steps=0, progress=False)
_TRAIN = ["train", "--data", "names2ids", "--partitions", "2", "--base", "tiny", "--max-steps", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _launch(*flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*cmd, "--main_process_port", str(_free_port()), "-m", "scpdr", *_TRAIN]


def test_accelerate_launch_ddp_on_gloo_writes_the_bundle_of_one_process(tmp_path):
    """The issue's command (``accelerate launch --num_processes 2 --cpu``: accelerate's simple
    launcher, one process unless MPI is set up) and two DDP processes on gloo (``--multi_gpu``
    on a CPU-only host, as torchrun) write the same bundle layout; under DDP each step sees twice
    the sequences, and the main process alone writes and reports."""
    from scpdr.models import read_bundle

    one, ddp = tmp_path / "one", tmp_path / "ddp"
    _run([*_launch("--cpu"), "--out", str(one)])
    if torch.cuda.is_available():  # pragma: no cover - --multi_gpu would train on the GPUs
        pytest.skip("the gloo run needs a host without CUDA")
    proc = _run([*_launch("--multi_gpu"), "--out", str(ddp)])
    assert proc.stdout.count("wrote bundle") == 1

    assert _layout(ddp) == _layout(one)
    assert not [p for p in _layout(ddp) if ".tmp-" in p or "checkpoint" in p]
    assert len(read_bundle(ddp).constituents) == len(read_bundle(one).constituents) == 2
    for i in range(2):
        info = json.loads((ddp / f"constituent-{i}" / TRAIN_INFO).read_text())
        single = json.loads((one / f"constituent-{i}" / TRAIN_INFO).read_text())
        assert info["global_step"] == single["global_step"] == 3
        assert info["placement"] == {
            "device": "cpu",
            "world_size": 2,
            "distributed": "MULTI_CPU",  # DDP on gloo
            "optim": "adamw_torch_fused",  # torch's fused AdamW runs on CPU
        }
        # twice the sequences per step; not exactly twice the epochs when a partition does not
        # split into whole DDP batches (the last batch of an epoch is partial)
        assert info["epochs_done"] == pytest.approx(
            2 * single["epochs_done"] / single["placement"]["world_size"], rel=0.05
        )


def test_plain_adamw_runs_as_torchs_fused_kernel_and_stays_the_same_run():
    assert resolve_optim("adamw_torch", "cpu") == "adamw_torch_fused"
    assert resolve_optim("adamw_torch_fused", "cpu") == "adamw_torch_fused"
    assert resolve_optim("sgd", "cpu") == "sgd"  # no fused kernel named: as asked
    assert plain_optim("adamw_torch_fused") == FALLBACK_OPTIM == plain_optim(FALLBACK_OPTIM)
    assert same_update("adamw_torch", "adamw_torch_fused")
    assert not same_update("adamw_torch", "adamw_bnb_8bit")
    assert not same_update(None, "adamw_torch")


def test_an_8bit_optimizer_falls_back_where_it_cannot_run(tmp_path, tiny_bundle, caplog):
    records = names2ids(n_train=8, n_val=1, seed=0).train
    # the fallback, run as torch's fused kernel (CPU has one)
    assert resolve_optim("adamw_bnb_8bit", "cpu") == "adamw_torch_fused"
    cfg = TrainConfig(max_steps=1, optim="adamw_bnb_8bit", **_FAST)
    out = finetune(records, base=tiny_bundle / "base", config=cfg, out=tmp_path / "m", device="cpu")
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["config"]["optim"] == "adamw_bnb_8bit"  # what was asked, and what ran:
    assert info["placement"]["optim"] == "adamw_torch_fused"
    assert "using adamw_torch" in caplog.text
    plain = finetune(
        records,
        base=tiny_bundle / "base",
        config=cfg.model_copy(update={"optim": "adamw_torch"}),
        out=tmp_path / "plain",
        device="cpu",
    )
    # another optimizer's run is another run (its checkpoints cannot resume this one)
    assert json.loads((plain / TRAIN_INFO).read_text())["fingerprint"] != info["fingerprint"]


def test_lora_with_gradient_checkpointing_trains(tmp_path, tiny_bundle):
    from safetensors.torch import load_file

    records = names2ids(n_train=8, n_val=1, seed=0).train
    cfg = TrainConfig(lora=True, lora_r=4, max_steps=2, gradient_checkpointing=True, **_FAST)
    out = finetune(records, base=tiny_bundle / "base", config=cfg, out=tmp_path / "lora")
    weights = load_file(str(out / "adapter_model.safetensors"))
    lora_b = [w for k, w in weights.items() if "lora_B" in k]
    assert lora_b and any(bool(torch.any(w != 0)) for w in lora_b)  # B starts at 0: it learned


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_an_error_before_training(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no CUDA device"):
        training_device("cuda")
    from scpdr.cli import main

    assert main([*_TRAIN, "--out", str(tmp_path / "b"), "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert main([*_TRAIN, "--out", str(tmp_path / "b"), "--device", "gpu"]) == 2
    assert "must be cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
