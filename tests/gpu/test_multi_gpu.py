"""Several GPUs (``-m gpu``; skips with fewer than 2): ``scpdr train`` under ``accelerate launch``
with DDP and with FSDP (the config of docs/scaling.md, on the tiny model) writes full, trained
weights from the main process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

FSDP = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: 2
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_reshard_after_forward: true
  fsdp_activation_checkpointing: false
"""
_TRAIN = ["train", "--data", "names2ids", "--n-train", "64", "--n-val", "8", "--partitions", "2"]
_TRAIN += ["--base", "tiny", "--max-steps", "2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["MULTI_GPU", "FSDP"])
def test_two_gpus_train_a_full_bundle(strategy, tmp_path):
    from safetensors.torch import load_file

    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if strategy == "FSDP":
        cfg = tmp_path / "fsdp.yaml"
        cfg.write_text(FSDP)
        launch += ["--config_file", str(cfg)]
    else:
        launch += ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    out = tmp_path / "bundle"
    cmd = [*launch, "--main_process_port", str(_port()), "-m", "scpdr", *_TRAIN, "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    base = load_file(str(Path(out) / "base" / "model.safetensors"))
    for i in range(2):
        info = json.loads((out / f"constituent-{i}" / "train_info.json").read_text())
        assert info["placement"]["world_size"] == 2
        assert info["placement"]["distributed"] == strategy
        trained = load_file(str(out / f"constituent-{i}" / "model.safetensors"))
        assert trained.keys() == base.keys()
        assert all(trained[k].shape == base[k].shape for k in base)  # gathered, not a shard
        assert any(not torch.equal(trained[k], base[k]) for k in base)
