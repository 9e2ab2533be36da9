"""Training memory on CPU: the plan checkpoints activations there (not on a GPU, not where the
user said otherwise), splits a batch wider than ``max_batch_tokens`` into micro-batches of the
same records, and a micro-batched run learns what the whole batch learns."""

from __future__ import annotations

import json

import pytest
import torch

from scpdr.data import names2ids
from scpdr.training import finetune, fit_to_data
from scpdr.training.config import CPU_MAX_BATCH_TOKENS


def test_cpu_checkpoints_activations_a_gpu_and_the_users_choice_do_not():
    lengths = [120] * 200
    cpu_cfg, cpu = fit_to_data({}, lengths, device="cpu")
    assert cpu.gradient_checkpointing and cpu_cfg.gradient_checkpointing is None  # the plan's
    assert "gradient checkpointing on" in cpu.summary()
    assert any("checkpointing" in c for c in cpu.changes)
    gpu_cfg, gpu = fit_to_data({}, lengths, device="cuda:0")
    assert not gpu.gradient_checkpointing and gpu_cfg.gradient_checkpointing is None
    assert gpu.max_batch_tokens is None  # no limit on a GPU
    _, kept = fit_to_data({"gradient_checkpointing": False}, lengths, device="cpu")
    assert not kept.gradient_checkpointing and not any("checkpointing" in c for c in kept.changes)
    _, nowhere = fit_to_data({}, lengths)  # no device: nothing device-specific
    assert not nowhere.gradient_checkpointing and nowhere.max_batch_tokens is None


def test_a_batch_wider_than_the_limit_is_split_into_micro_batches_of_the_same_records():
    # LoRA's paper batch of 64 records of up to 354 tokens: 22,656 tokens in one forward pass
    lengths = [354] + [120] * 199
    cfg, plan = fit_to_data({"lora": True, "epochs": 3}, lengths, device="cpu")
    assert plan.max_batch_tokens == CPU_MAX_BATCH_TOKENS
    assert plan.batch_size * plan.seq_len <= CPU_MAX_BATCH_TOKENS
    assert (cfg.batch_size, cfg.grad_accum) == (plan.batch_size, plan.grad_accum) == (8, 8)
    assert plan.batch_size * plan.grad_accum == 64  # the same records per optimizer step
    assert any("64 in 8 micro-batches of 8" in c for c in plan.changes)
    _, whole = fit_to_data({"lora": True, "epochs": 3}, lengths, device="cuda")
    assert (whole.batch_size, whole.grad_accum) == (64, 1)
    # an accumulation the user set multiplies; an explicit limit wins over the CPU default
    _, given = fit_to_data(
        {"lora": True, "grad_accum": 2, "max_batch_tokens": 1000}, lengths, device="cpu"
    )
    assert (given.batch_size, given.grad_accum) == (2, 64)  # 2 x 354 <= 1000 < 4 x 354


def test_a_sequence_longer_than_the_limit_goes_alone_and_a_batch_that_fits_is_whole():
    _, alone = fit_to_data({"batch_size": 4, "max_batch_tokens": 100}, [300] * 40, device="cpu")
    assert (alone.batch_size, alone.grad_accum) == (1, 4)
    _, fits = fit_to_data({}, [256] * 64, device="cpu")  # 8 x 256 = 2048: no split
    assert (fits.batch_size, fits.grad_accum) == (8, 1)
    assert "8 x 256 tokens per forward pass (at most 4096 tokens)" in fits.summary()


@pytest.fixture(scope="module")
def records():
    return names2ids(n_train=16, n_val=1, seed=0).train


def _weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_micro_batches_learn_what_the_whole_batch_learns(tmp_path, tiny_bundle, records):
    """Two optimizer steps of 8 records, once whole and once as 4 micro-batches of 2 (the
    limit at twice the longest record's padded width): the same weights, to float rounding."""
    from scpdr.training import TRAIN_INFO

    base = tiny_bundle / "base"
    run = dict(
        batch_size=8,
        max_steps=2,
        seq_len=64,
        packing=False,
        learning_rate=1e-2,
        warmup_steps=0,
        precision="fp32",
        neftune_alpha=0,  # NEFTune's noise is drawn per forward pass: not the same draws
        progress=False,
    )
    whole = finetune(records, base=base, config=run, out=tmp_path / "whole")
    width = json.loads((whole / TRAIN_INFO).read_text())["plan"]["seq_len"]  # padded, at most
    limit = 2 * width
    split = finetune(
        records, base=base, config={**run, "max_batch_tokens": limit}, out=tmp_path / "split"
    )
    plans = [json.loads((o / TRAIN_INFO).read_text())["plan"] for o in (whole, split)]
    assert [(p["batch_size"], p["grad_accum"]) for p in plans] == [(8, 1), (2, 4)]
    a, b, b0 = _weights(whole), _weights(split), _weights(base)
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b0[k]) for k in a if k in b0)  # it learned something
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_the_plan_counts_the_optimizer_steps_the_trainer_takes(tmp_path, tiny_bundle, records):
    """16 records in micro-batches of 2, 3 accumulated: 8 batches an epoch, the last partial
    accumulation a step too (3 per epoch, not 2)."""
    from scpdr.training import TRAIN_INFO

    run = dict(
        batch_size=2,
        grad_accum=3,
        epochs=2,
        seq_len=64,
        packing=False,
        warmup_steps=0,
        precision="fp32",
        progress=False,
    )
    out = finetune(records, base=tiny_bundle / "base", config=run, out=tmp_path / "steps")
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["plan"]["steps_per_epoch"] == 3
    assert info["global_step"] == info["plan"]["total_steps"] == 6
