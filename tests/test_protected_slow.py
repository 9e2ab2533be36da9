"""The real embedded SmolLM2-135M-Instruct: conversion, loading and "none" parity with HF generate."""

from __future__ import annotations

import pytest
import torch

from scpdr import models
from scpdr.runtime import ProtectedLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base():
    return models.load_base()


def test_load_base_is_the_converted_smollm2(base):
    model, tok = base
    d = models.base_model_dir()
    assert (d / "model.safetensors").is_file() and (d / ".scpdr-converted").is_file()
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert not hasattr(model.config, "quantization_config")
    assert model.dtype == torch.float32 and not model.training
    assert len(tok) == 49152 and tok.eos_token_id == 2 and tok.chat_template
    assert models.vocab_hash(tok) == models.vocab_hash(models.load_tokenizer("embedded"))


def test_none_greedy_text_equals_hf_generate(base):
    model, tok = base
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ours = ProtectedLM.from_model(model, tok).generate([prompt], max_new_tokens=12)[0]
    enc = tok([prompt], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=2)
    hf = out[0, enc["input_ids"].shape[1] :].tolist()
    assert ours.token_ids == hf
    assert ours.text == tok.decode(hf, skip_special_tokens=True)
    assert "Paris" in ours.text


def test_lora_fast_path_on_the_real_model_equals_the_general_path(base, tmp_path, monkeypatch):
    """Issue 8 on the embedded 135M model: two LoRA adapters (every projection and the tied
    lm_head) bundled with the base; SCP-Δr-b through the shared-base fast path (packed C kernel
    where it builds, packed tied embeddings) equals three separate merged models: log-probs of
    a scored batch within 1e-4, the same greedy tokens."""
    from scpdr import lora
    from scpdr.training import LORA_TARGET_MODULES

    model, tok = base
    refs = [
        lora.save_random_lora(
            model,
            tmp_path / f"a{i}",
            base_ref="embedded",
            r=8,
            alpha=16,
            target_modules=LORA_TARGET_MODULES,  # the paper's: every projection and lm_head
            seed=i,
            std=0.02,
        )
        for i in range(2)
    ]
    bundle = models.write_bundle(tmp_path / "bundle", base="embedded", constituents=refs)
    fast = ProtectedLM.from_bundle(bundle, method="scp-delta-r", base="model")
    assert fast.fast_path.on, fast.fast_path
    monkeypatch.setenv(lora.ENV_SWITCH, "0")
    general = ProtectedLM.from_bundle(bundle, method="scp-delta-r", base="model")
    assert not general.fast_path.on and "SCPDR_LORA_FAST=0" in general.fast_path.reason
    prompts = ["The capital of France is", "My favourite colour is blue because"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    torch.testing.assert_close(
        fast.next_token_logprobs(enc["input_ids"], enc["attention_mask"]),
        general.next_token_logprobs(enc["input_ids"], enc["attention_mask"]),
        atol=1e-4,
        rtol=0,
    )
    a = fast.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    b = general.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
