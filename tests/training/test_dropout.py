"""LoRA's dropout on CPU (:mod:`scpdr.training.dropout`): the rate it states, an unbiased output,
seeded masks that gradient checkpointing recomputes identically, and every LoRA dropout of a
PEFT model replaced."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from scpdr.training.dropout import WordDropout, replace_lora_dropout


def test_the_mask_drops_at_its_stated_rate_and_the_output_is_unbiased():
    drop = WordDropout(0.05).train()
    assert drop.rate == 3277 / 65536
    torch.manual_seed(0)
    n = 1_000_003  # not a multiple of the four draws per word
    y = drop(torch.ones(n))
    dropped = int((y == 0).sum())
    sd = math.sqrt(n * drop.rate * (1 - drop.rate))
    assert abs(dropped - n * drop.rate) < 5 * sd
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, drop.scale))
    assert float(y.mean()) == pytest.approx(1.0, abs=5 * drop.scale * sd / n)
    # the draws spread over the whole 16-bit range: a rate near one half is right too
    half = WordDropout(0.5).train()
    frac = float((half(torch.ones(n)) == 0).float().mean())
    assert abs(frac - 0.5) < 5 * math.sqrt(0.25 / n)


def test_eval_mode_rate_zero_and_a_bad_rate():
    x = torch.randn(4, 8)
    assert torch.equal(WordDropout(0.3).eval()(x), x)
    assert torch.equal(WordDropout(0.0).train()(x), x)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        WordDropout(1.0)


def test_bf16_inputs_keep_their_dtype():
    y = WordDropout(0.1).train()(torch.ones(64, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    kept = y[y != 0]
    assert 0 < kept.numel() < y.numel()
    assert torch.all(kept == torch.tensor(1 / (1 - 6554 / 65536), dtype=torch.bfloat16))


def test_seeded_masks_repeat_and_checkpointing_recomputes_the_same_mask():
    lin, drop = nn.Linear(16, 16), WordDropout(0.2).train()

    def block(x):
        return lin(drop(x)).tanh()

    def grads(use_checkpoint: bool):
        torch.manual_seed(1)
        x = torch.randn(32, 16, requires_grad=True)
        torch.manual_seed(2)
        y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        y.sum().backward()
        out = (y.detach().clone(), x.grad.clone(), lin.weight.grad.clone())
        lin.zero_grad()
        return out

    plain, again, ckpt = grads(False), grads(False), grads(True)
    for a, b, c in zip(plain, again, ckpt, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)


def test_every_lora_dropout_of_a_peft_model_is_replaced():
    from scpdr.testing import tiny_model
    from scpdr.training import TrainConfig
    from scpdr.training.loading import wrap_lora

    model = wrap_lora(tiny_model(0), TrainConfig(lora=True, lora_r=4).resolved())

    def lora_drops() -> list[nn.Module]:
        return [
            d
            for m in model.modules()
            if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict)
            for d in m.lora_dropout.values()
        ]

    before = lora_drops()
    assert before and all(type(d) is nn.Dropout for d in before)  # PEFT's, one per adapter
    assert replace_lora_dropout(model) == len(before)
    after = lora_drops()
    assert len(after) == len(before) and all(type(d) is WordDropout for d in after)
    assert all(d.p == 0.05 for d in after)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
