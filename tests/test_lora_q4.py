"""GGUF Q4_1 blocks on the packed CPU kernel (:mod:`scpdr.kernels.q4`).

The kernel rebuilds each weight from its block as the GGUF loader does (a float32 product, then a
float32 sum) and adds in the float32 loop's order, so a layer with q4 panels must equal, bit for
bit, the float32 kernel on the dequantized weight — in the in-register path (up to 3 rows) and in
the path that dequantizes a panel once for several tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr import kernels, testing
from scpdr.kernels.gemm import linear_call, unpack_panels
from scpdr.kernels.q4 import (
    dequantize_blocks,
    gguf_q4_source,
    pack_q4_panels,
    q4_exact,
    unpack_q4_panels,
)
from scpdr.lora import GroupMode, StackedLoraLinear

GEMM = kernels.gemm.library()
KERNEL = GEMM is not None and GEMM.tiled
needs_kernel = pytest.mark.skipif(not KERNEL, reason="no C compiler: no packed kernel here")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_dequantize_is_gguf_pys():
    """The loader's own dequantization (gguf-py, which transformers calls): the same bits."""
    from gguf import GGMLQuantizationType, dequantize

    blocks = testing.random_q4_blocks(torch.Generator().manual_seed(0), 70, 96)
    ref = dequantize(blocks.numpy().reshape(70, -1), GGMLQuantizationType.Q4_1)
    assert ref.dtype == np.float32 and ref.shape == (70, 96)
    assert torch.equal(dequantize_blocks(blocks), torch.from_numpy(ref))


@pytest.mark.parametrize("width", [16, 24, 32])
@pytest.mark.parametrize("n", [1, 24, 70])
def test_q4_panels_hold_the_dequantized_weight(width, n):
    blocks = testing.random_q4_blocks(torch.Generator().manual_seed(n), n, 64)
    packed = pack_q4_panels(blocks, width)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // width), 2, 24 * width)
    w = dequantize_blocks(blocks)
    assert torch.equal(unpack_q4_panels(packed, n), w)
    assert torch.equal(unpack_panels(packed, n), w)
    # column 3 of panel 0, block 1: its d, then row 0: inputs 32 (low nibble) and 33 (high);
    # in the GGUF block, byte i's low nibble is input i and its high nibble input i + 16
    if n > 3:
        d = packed[0, 1, 4 * 3 : 4 * 3 + 4].view(torch.float32)
        assert d.item() == blocks[3, 1, :2].view(torch.float16).float().item()
        byte = int(packed[0, 1, 8 * width + 3])
        assert byte & 15 == int(blocks[3, 1, 4]) & 15 and byte >> 4 == int(blocks[3, 1, 5]) & 15
    assert q4_exact(blocks, w)
    w2 = w.clone()
    w2[0, 0] = torch.nextafter(w2[0, 0], torch.tensor(1.0))  # one ulp off: not exact
    assert not q4_exact(blocks, w2)
    assert not q4_exact(blocks, w[:, :32])


def _layers(gen, n_in, n_out, rank, lora, *, exact=True):
    blocks = testing.random_q4_blocks(gen, n_out, n_in)
    layer = torch.nn.Linear(n_in, n_out, bias=True)
    with torch.no_grad():
        layer.weight.copy_(dequantize_blocks(blocks))
        layer.bias.copy_(torch.randn(n_out, generator=gen))
        if not exact:
            layer.weight[0, 0] += 1.0
    a = b = None
    if lora:
        a = torch.randn(lora, n_in, rank, generator=gen)
        b = torch.randn(lora, rank, n_out, generator=gen)
    mode = GroupMode()
    q4 = StackedLoraLinear(layer, a, b, mode, gemm=GEMM, q4=blocks)
    f32 = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    return layer, mode, q4, f32


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_in=st.sampled_from([32, 64, 576, 1536, 6016]),
    n_out=st.sampled_from([1, 5, 64, 65, 130]),
    rank=st.sampled_from([1, 3, 70]),
    groups=st.integers(1, 4),
    lora=st.integers(0, 4),
    rows=st.integers(1, 30),
)
def test_q4_weights_equal_the_float32_kernel(seed, n_in, n_out, rank, groups, lora, rows):
    """Property: a layer with q4 panels gives exactly what the float32 kernel gives on the
    dequantized weight (1 to 3 rows in registers, more through the dequantized panel, the L2 row
    chunks of a wide input, LoRA deltas of stacked groups and of one group), and matches the
    torch reference on its own panels."""
    gen = torch.Generator().manual_seed(seed)
    lora = min(lora, groups)
    layer, mode, lin, ref = _layers(gen, n_in, n_out, rank, lora)
    assert lin.weight_format == "q4_1" and "q4_1 weights" in repr(lin)
    assert ref.weight_format == "float32"
    assert torch.equal(lin.weight, layer.weight)
    x = torch.randn(groups * rows, n_in, generator=gen)
    with torch.inference_mode():
        mode.stacked = groups
        got = lin(x)
        assert torch.equal(got, ref(x))
        tol = {"atol": 2e-5 * n_in**0.5 * (1 + rank**0.5), "rtol": 1e-4}
        torch.testing.assert_close(got, lin.reference_forward(x), **tol)
        mode.stacked, mode.single = None, 0 if lora else None
        assert torch.equal(lin(x[:rows]), ref(x[:rows]))


@needs_kernel
def test_q4_blocks_that_do_not_give_the_weight_are_not_used():
    gen = torch.Generator().manual_seed(3)
    layer, mode, lin, ref = _layers(gen, 64, 40, 2, 1, exact=False)
    assert lin.weight_format == "float32"
    mode.stacked = 1
    x = torch.randn(2, 64, generator=gen)
    with torch.inference_mode():
        assert torch.equal(lin(x), ref(x))
    assert torch.equal(lin.weight, layer.weight)


@needs_kernel
def test_q4_reference_keeps_autograd_and_calls_check_the_inputs():
    gen = torch.Generator().manual_seed(1)
    _, mode, lin, _ = _layers(gen, 64, 40, 2, 1)
    mode.stacked = 1
    x = torch.randn(3, 64, generator=gen, requires_grad=True)
    y = lin(x)  # autograd: the torch reference on the dequantized panels
    assert y.dtype == torch.float32 and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None
    with pytest.raises(ValueError, match="q4 panels of 64 inputs"):
        linear_call((3, 96), lin.weight_packed, 40, groups=1)


def test_gguf_source_needs_a_llama_config(tmp_path):
    class Config:
        model_type = "gpt2"

    assert gguf_q4_source(tmp_path / "missing.gguf", Config()) is None


@pytest.mark.slow
def test_embedded_gguf_blocks_are_the_loaded_weights_and_the_stack_is_bit_identical(tmp_path):
    """On the embedded SmolLM2-135M: every projection of the 30 layers has Q4_1 blocks in the
    GGUF file that dequantize (q_proj and k_proj with their rows permuted back) to the converted
    model's weights exactly; a LoRA stack over it with q4 panels gives the float32 panels' logits
    bit for bit."""
    from safetensors import safe_open

    from scpdr import models
    from scpdr.lora import StackedLoRA

    model, _ = models.load_base()
    source = gguf_q4_source(models.embedded_gguf_path(), model.config)
    assert source is not None and len(source) == 210
    names = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n
    ]
    assert len(names) == 210
    with safe_open(str(models.base_model_dir() / "model.safetensors"), "pt") as f:
        for name in names:
            blocks = source(name)
            assert blocks is not None and q4_exact(blocks, f.get_tensor(name + ".weight")), name
    assert source("lm_head") is None  # the head is tied to the Q8_0 embeddings

    target = "model.layers.0.self_attn.q_proj"
    adapter = testing.random_lora_adapter(model, target, rank=4)
    ids = torch.tensor([[1, 504, 3, 9007, 28]])
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with kernels.force("packed_gemm", "kernel"):
        q4 = StackedLoRA(model, [adapter, None], ["a", "base"], q4_source=source)
        formats = {m.weight_format for m in q4.model.modules() if isinstance(m, StackedLoraLinear)}
        assert formats == {"q4_1", "float32"}  # the projections, and the head
        with torch.inference_mode():
            got = q4(ids, mask, pos)
        del q4, model
        f32 = StackedLoRA(models.load_base()[0], [adapter, None], ["a", "base"])
        with torch.inference_mode():
            want = f32(ids, mask, pos)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
