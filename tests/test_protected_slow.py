"""The real embedded SmolLM2-135M-Instruct: conversion, loading and "none" parity with HF generate."""

from __future__ import annotations

import pytest
import torch

from scpdr import models
from scpdr.protected import ProtectedLM

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
