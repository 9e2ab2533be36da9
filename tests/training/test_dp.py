"""DP fine-tuning (scpdr.training.dp) on the tiny random Llama: DP implies LoRA and one record per
sequence; the LoRA weights move with the per-example gradients (opacus#820: with some
Opacus/PEFT versions they never change); the ε a run reports is Opacus' PRV accountant's for the
recorded σ, q and steps; `scpdr train --dp-epsilon 8` records it all in the bundle manifest."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from scpdr.data import names2ids
from scpdr.errors import ConfigError
from scpdr.training import TRAIN_INFO, CausalCollator, TrainConfig, build_sequences, finetune
from scpdr.training.dp import dp_plan, require_opacus, spent_epsilon

pytest.importorskip("opacus", reason="the `dp` extra (in `dev`): pip install 'scpdr[dp]'")

_TINY = dict(seq_len=32, lora_r=4, lora_dropout=0.0, warmup_steps=0, progress=False)


@pytest.fixture(scope="module")
def records():
    return names2ids(n_train=8, n_val=1, seed=0).train


def test_dp_implies_lora_and_one_record_per_sequence():
    cfg = TrainConfig(dp_epsilon=8)
    assert cfg.dp and cfg.lora and cfg.packing is False
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg
    for bad, match in (
        (dict(lora=False), "LoRA adapters only"),
        (dict(packing=True), "one record"),
        (dict(grad_accum=2), "grad_accum must be 1"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(dp_epsilon=8, **bad)
    with pytest.raises(ValueError, match="without dp_epsilon"):
        TrainConfig(dp_delta=1e-5)
    # DP off: the fingerprint of runs trained before DP existed is unchanged
    assert TrainConfig().fingerprint() != TrainConfig(dp_epsilon=8).fingerprint()


def test_noise_is_calibrated_for_the_whole_schedule_and_epsilon_is_the_accountants():
    cfg = TrainConfig(dp_epsilon=2.0, batch_size=4)
    plan = dp_plan(cfg, n_records=40, steps=30)
    assert plan.sample_rate == pytest.approx(0.1) and plan.delta == pytest.approx(1 / 40)
    assert plan.noise_multiplier > 0 and 2.0 - 0.05 <= plan.epsilon <= 2.0
    # Opacus' accountant recomputed for the recorded (σ, q, steps)
    from opacus.accountants import PRVAccountant

    assert plan.accountant == "prv"
    acc = PRVAccountant()
    acc.history = [(plan.noise_multiplier, plan.sample_rate, plan.steps)]
    assert acc.get_epsilon(delta=plan.delta) == pytest.approx(plan.epsilon, rel=1e-6)
    # the smallest such σ: 10% less noise overspends
    less = spent_epsilon(
        noise_multiplier=0.9 * plan.noise_multiplier, sample_rate=0.1, steps=30, delta=1 / 40
    )
    assert less > 2.0
    # more steps at the same ε need more noise
    assert dp_plan(cfg, n_records=40, steps=120).noise_multiplier > plan.noise_multiplier


def test_lora_b_moves_with_the_per_example_gradients(tmp_path, records, tiny_bundle):
    # one step, every record in the batch (q = 1), almost no noise (ε = 1e7): Adam's first step
    # moves every weight by -lr * sign(gradient), so lora_B (zero at init) must move
    # (opacus#820), and along the sum of the examples' clipped gradients, computed here one
    # example at a time by plain autograd (Opacus' own slow reference, grad_samples/common.py)
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import set_seed

    from scpdr.models import load_model, load_tokenizer

    base = tiny_bundle / "base"
    cfg = TrainConfig(
        dp_epsilon=1e7,
        dp_max_grad_norm=1.0,
        max_steps=1,
        batch_size=len(records),
        learning_rate=1e-3,
        seed=5,
        **_TINY,
    )
    out = finetune(records, base=str(base), config=cfg, out=tmp_path / "dp")
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["dp"]["sample_rate"] == 1.0 and info["dp"]["noise_multiplier"] > 0
    trained = load_file(str(out / "adapter_model.safetensors"))
    lora_b = {k.replace(".weight", ""): v for k, v in trained.items() if "lora_B" in k}
    assert lora_b and all(v.abs().max() > 1e-4 for v in lora_b.values())  # opacus#820

    set_seed(5)
    res = cfg.resolved()
    ref = get_peft_model(
        load_model(base),
        LoraConfig(
            r=res.lora_r,
            lora_alpha=res.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(res.lora_target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    rows = build_sequences(records, load_tokenizer(base), seq_len=32, packing=False, seed=5)
    clipped = {n: torch.zeros_like(p) for n, p in params.items()}
    for row in rows:
        batch = CausalCollator()([row])
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = torch.log_softmax(logits[0, :-1].float(), -1)
        tgt = batch["labels"][0, 1:]
        keep = tgt != -100
        loss = -logp[keep].gather(-1, tgt[keep].unsqueeze(-1)).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        for n, g in zip(params, grads, strict=True):
            clipped[n] += g * min(1.0, 1.0 / (float(norm) + 1e-6))
    agree = total = 0
    for name, g in clipped.items():
        if "lora_B" not in name:
            continue
        key = name.replace(".default", "").removesuffix(".weight")  # the adapter file's name
        big = g.abs() > 0.1 * g.abs().max()
        agree += int((torch.sign(lora_b[key][big]) == -torch.sign(g[big])).sum())
        total += int(big.sum())
    assert total > 0 and agree / total > 0.95


def test_cli_train_dp_writes_epsilon_and_sigma_into_the_manifest(tmp_path, capsys):
    from scpdr.cli import main
    from scpdr.models import read_bundle

    out = tmp_path / "bundle"
    argv = ["train", "--data", "names2ids", "--n-train", "12", "--n-val", "2"]
    argv += ["--dp-epsilon", "8", "--base", "tiny", "--max-steps", "3", "--out", str(out)]
    argv += ["--seq-len", "32", "--lora-r", "4", "--batch-size", "4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "DP-SGD" in printed and "noise multiplier" in printed
    assert "precision fp32: DP-SGD trains in fp32" in printed  # its plan: batches padded exactly
    assert "rounded up to a multiple" not in printed
    dp = read_bundle(out).extra["dp"]
    assert dp["epsilon"] <= 8 and len(dp["constituents"]) == 2
    for c in dp["constituents"]:
        assert c["epsilon"] <= 8 and c["noise_multiplier"] > 0 and c["steps"] == 3
        assert c["delta"] == pytest.approx(1 / 6)  # 1/n, n = the constituent's records
    assert read_bundle(out).extra["train_config"]["lora"] is True


def test_missing_opacus_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(ImportError, match=r"scpdr\[dp\]"):
        require_opacus()
    with pytest.raises(ConfigError, match="dp_epsilon"):
        dp_plan(TrainConfig(), n_records=4, steps=1)
