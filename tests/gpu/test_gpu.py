"""CUDA paths (``-m gpu``; every test here skips without CUDA): device resolution, bf16 models
with fp32 aggregation, training with bf16 + gradient checkpointing + 8-bit Adam, the LoRA
shared-base path on torch, and an experiment's stages on the GPU.

The suite's conftest sets ``SCPDR_DEVICE=cpu`` (the CPU tests compare CPU with CPU); these tests
clear it, so that the library's own default (cuda when available) is what they see. They ran on
an H100 once (docs/scaling.md)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_devices_resolve_to_cuda():
    from scpdr.device import model_dtype, resolve_device
    from scpdr.errors import ConfigError

    assert resolve_device(None) == "cuda"
    assert resolve_device("cuda:0") == "cuda:0"
    assert model_dtype("cuda") is torch.bfloat16 and model_dtype("cpu") is None
    with pytest.raises(ConfigError, match="torch sees"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_bf16_scorers_on_cuda_aggregate_in_fp32_close_to_cpu(tiny_bundle):
    """load_scorers on CUDA: bf16 models, fp32 log-probs, within bf16 rounding of the CPU's."""
    from scpdr.attacks.bundle_scorers import load_scorers

    methods = ["none", "cp-delta", "scp-delta-r-b"]
    cpu = load_scorers(tiny_bundle, methods, device="cpu")
    gpu = load_scorers(tiny_bundle, methods, device="cuda")
    tok = cpu.tokenizer
    enc = tok(["Name: Ada Lovelace, ID: 1815"], return_tensors="pt")
    for name in methods:
        a = cpu[name].score(enc["input_ids"], enc["attention_mask"])
        b = gpu[name].score(enc["input_ids"], enc["attention_mask"])
        assert b.dtype is torch.float32 and b.device.type == "cuda"
        assert torch.allclose(a, b.cpu(), atol=0.25), name


def test_protected_lm_generates_on_cuda(tiny_bundle):
    from scpdr import ProtectedLM

    for method in ("cp-delta", "scp-delta-r"):
        lm = ProtectedLM.from_bundle(tiny_bundle, method=method, device="cuda")
        (gen,) = lm.generate(["Name: Ada"], max_new_tokens=4)
        assert len(gen.token_ids) == 4 and all(k >= 0 for k in gen.k_x)


def test_lora_shared_base_path_runs_on_torch_on_cuda(tmp_path, tiny_bundle):
    """The shared-base LoRA path on CUDA (the C kernels are CPU-only): two trained adapters over
    the tiny base, scored on CUDA through the fast path, close to the CPU's scores."""
    from scpdr import ProtectedLM
    from scpdr.data import names2ids
    from scpdr.models import write_bundle
    from scpdr.training import TrainConfig, finetune

    base = tiny_bundle / "base"
    cfg = TrainConfig(
        lora=True, lora_r=4, max_steps=1, batch_size=2, seq_len=32, warmup_steps=0, progress=False
    )
    records = names2ids(n_train=8, n_val=1, seed=0).train
    adapters = [
        finetune(records[i::2], base=base, config=cfg, out=tmp_path / f"a{i}", device="cpu")
        for i in range(2)
    ]
    bundle = write_bundle(tmp_path / "bundle", base=base, constituents=adapters)
    gpu = ProtectedLM.from_bundle(bundle, method="cp-delta", device="cuda")
    cpu = ProtectedLM.from_bundle(bundle, method="cp-delta", device="cpu")
    assert gpu.fast_path and cpu.fast_path
    enc = cpu.tokenizer(["Name: Ada Lovelace, ID: 1815"], return_tensors="pt")
    a = cpu.score(enc["input_ids"], enc["attention_mask"])
    b = gpu.score(enc["input_ids"], enc["attention_mask"])
    assert b.device.type == "cuda" and torch.allclose(a, b.cpu(), atol=0.25)


def test_training_on_cuda_with_bf16_checkpointing_and_8bit_adam(tmp_path, tiny_bundle):
    from scpdr.data import names2ids
    from scpdr.training import TRAIN_INFO, TrainConfig, finetune

    cfg = TrainConfig(
        max_steps=2,
        batch_size=2,
        seq_len=32,
        warmup_steps=0,
        learning_rate=1e-3,
        bf16=True,
        gradient_checkpointing=True,
        optim="adamw_bnb_8bit",
        progress=False,
    )
    records = names2ids(n_train=8, n_val=1, seed=0).train
    out = finetune(records, base=tiny_bundle / "base", config=cfg, out=tmp_path / "m")
    info = json.loads((out / TRAIN_INFO).read_text())
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    assert info["placement"]["device"] == "cuda"
    assert info["placement"]["optim"] == ("adamw_bnb_8bit" if has_bnb else "adamw_torch_fused")
    assert info["global_step"] == 2


def test_experiment_stages_run_on_cuda(tmp_path):
    """configs/tiny.yaml with device: cuda: every stage runs, the rows are finite."""
    import math
    from pathlib import Path

    from scpdr.experiment import load_config, run_experiment

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    cfg = load_config(tiny).model_copy(update={"device": "cuda", "sweeps": []})
    result = run_experiment(cfg, tmp_path, progress=False)
    rows = json.loads(result.results_json.read_text())
    assert rows and all(math.isfinite(r["value"]) for r in rows if r.get("value") is not None)


def test_chunked_loss_on_cuda_is_the_models_own_loss():
    """The chunked loss (training/loss.py) on CUDA: the model's own loss and gradients, in fp32
    and under bf16 autocast (to bf16 rounding), the result on the GPU."""
    from scpdr.data import names2ids
    from scpdr.testing import tiny_model, tiny_tokenizer
    from scpdr.training import CausalCollator, build_sequences
    from scpdr.training.loss import ChunkedCausalLMLoss

    tok = tiny_tokenizer()
    records = names2ids(n_train=6, n_val=1, seed=0).train
    rows = build_sequences(records[:4], tok, seq_len=64, packing=False, shuffle=False)
    batch = CausalCollator(pad_token_id=tok.eos_token_id)(rows)
    batch = {k: v.cuda() for k, v in batch.items()}
    model = tiny_model(0).cuda().train()
    params = [p for p in model.parameters() if p.requires_grad]
    labels = batch.pop("labels")
    for autocast, rtol in ((False, 1e-5), (True, 2e-2)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            ref = model(**batch, labels=labels).loss  # the model's own
            out = model(**batch, output_hidden_states=True, logits_to_keep=1)
        fn = ChunkedCausalLMLoss(
            model.get_output_embeddings(),
            vocab_size=model.config.vocab_size,
            autocast="cuda" if autocast else None,
        )
        ours = fn(out, labels)
        assert ours.device.type == "cuda" and ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=0)
        g_ref = torch.autograd.grad(ref, params)
        g_ours = torch.autograd.grad(ours, params)
        for a, b in zip(g_ours, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))
