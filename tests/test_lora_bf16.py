"""bf16 weights on the packed CPU kernel (``--precision bf16`` for serving on CPU).

The kernel widens bf16 panels to float32 exactly and adds in the float32 loop's order, so a layer
with bf16 panels must equal, bit for bit, the float32 kernel on the bf16-rounded weight; and the
whole stack must be the model whose weights were rounded to bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr import kernels, testing
from scpdr.errors import ConfigError
from scpdr.kernels.gemm import lora_linear_reference, pack_panels, unpack_panels
from scpdr.lora import GroupMode, PackedEmbedding, StackedLoRA, StackedLoraLinear
from scpdr.serve.config import ServeConfig

GEMM = kernels.gemm.library()
KERNEL = GEMM is not None and GEMM.tiled
needs_kernel = pytest.mark.skipif(not KERNEL, reason="no C compiler: no packed kernel here")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("k", [1, 2, 7, 64, 577])
@pytest.mark.parametrize("width", [16, 24, 32])
def test_bf16_panels_round_trip_to_the_rounded_weight(k, width):
    """bf16 panels hold W rounded to bf16 (nearest even), pairs of inputs side by side, a zero
    padding an odd k; unpacking gives the rounded W back."""
    w = torch.randn(70, k) * 3
    packed = pack_panels(w, width, dtype=torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    assert packed.shape == (-(-70 // width), (k + 1) // 2, width, 2)
    assert torch.equal(unpack_panels(packed, 70, k).float(), _rounded(w))
    # column c, inputs 2i and 2i + 1 side by side
    pair = torch.cat([w[3, :2], torch.zeros(max(0, 2 - k))])
    assert torch.equal(packed[0, 0, 3].float(), _rounded(pair))
    if k % 2:
        assert not packed[:, -1, :, 1].any()  # the odd k's padding is zero
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_panels(w, width, dtype=torch.float16)


def _layer(gen, n_in, n_out, rank, lora, weight_dtype):
    layer = torch.nn.Linear(n_in, n_out, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        layer.bias.copy_(torch.randn(n_out, generator=gen))
    a = b = None
    if lora:
        a = torch.randn(lora, n_in, rank, generator=gen)
        b = torch.randn(lora, rank, n_out, generator=gen)
    mode = GroupMode()
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM, weight_dtype=weight_dtype)
    return layer, a, b, mode, lin


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_in=st.sampled_from([1, 2, 7, 64, 201, 1536, 7001]),
    n_out=st.sampled_from([1, 5, 64, 65, 130]),
    rank=st.sampled_from([1, 3, 70]),
    groups=st.integers(1, 4),
    lora=st.integers(0, 4),
    rows=st.integers(1, 30),
)
def test_bf16_weights_equal_the_float32_kernel_on_the_rounded_weight(
    seed, n_in, n_out, rank, groups, lora, rows
):
    """Property: a layer with bf16 panels gives exactly what the float32 kernel gives on the
    bf16-rounded weight (same sums in the same order; odd input counts, tiles of every height,
    the L2 row chunks, LoRA deltas of stacked groups and of one group), and matches the torch
    reference on its own panels."""
    gen = torch.Generator().manual_seed(seed)
    lora = min(lora, groups)
    layer, a, b, mode, lin = _layer(gen, n_in, n_out, rank, lora, torch.bfloat16)
    with torch.no_grad():
        rounded = torch.nn.Linear(n_in, n_out, bias=True)
        rounded.weight.copy_(_rounded(layer.weight))
        rounded.bias.copy_(layer.bias)
    ref = StackedLoraLinear(rounded, a, b, mode, gemm=GEMM)
    assert lin.weight_packed.dtype == torch.bfloat16 and "bf16 weights" in repr(lin)
    assert torch.equal(lin.weight, rounded.weight)  # float32, the rounded values
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
def test_bf16_reference_widens_and_keeps_autograd():
    """The torch reference on bf16 panels computes in float32 (x is not rounded) and carries
    gradients to x."""
    gen = torch.Generator().manual_seed(1)
    layer, a, b, mode, lin = _layer(gen, 9, 40, 2, 1, torch.bfloat16)
    mode.stacked = 1
    x = torch.randn(3, 9, generator=gen, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.float32 and y.grad_fn is not None
    want = x @ _rounded(layer.weight).t() + layer.bias + (x @ a[0]) @ b[0]
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    y.sum().backward()
    assert x.grad is not None
    packed = lin.weight_packed
    direct = lora_linear_reference(x.detach(), packed, 40, groups=1)
    torch.testing.assert_close(direct, x.detach() @ _rounded(layer.weight).t(), atol=1e-5, rtol=0)


def test_bf16_weights_need_the_packed_kernel():
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="packed kernel"):
        StackedLoraLinear(layer, None, None, GroupMode(), weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight_dtype"):
        StackedLoRA(testing.tiny_model(0), [None], ["a"], weight_dtype=torch.float16)


def _tiny():
    return testing.tiny_model(3, hidden_size=16, intermediate_size=40, num_layers=1, vocab_size=97)


def _logits(stack, ids):
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        return stack(ids, mask, pos)


@needs_kernel
def test_stack_with_bf16_weights_is_the_bf16_rounded_model():
    """StackedLoRA(weight_dtype=bf16) on the kernel: every group's logits are those of the
    same stack built on the model whose linear weights were rounded to bf16 (float32 kernel),
    the tied input embeddings read (widened) from the bf16 head; the adapters are not rounded."""
    model = _tiny()
    adapter = testing.random_lora_adapter(model, "model.layers.0.self_attn.q_proj", rank=3)
    rounded = _tiny()
    with torch.no_grad():
        for mod in rounded.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(_rounded(mod.weight))
    ids = torch.tensor([[1, 5, 96, 40, 7], [0, 64, 65, 2, 3]])
    with kernels.force("packed_gemm", "kernel"):
        bf16 = StackedLoRA(model, [adapter, None], ["a", "base"], weight_dtype=torch.bfloat16)
        ref = StackedLoRA(rounded, [adapter, None], ["a", "base"])
    emb = bf16.model.get_input_embeddings()
    if rounded.config.tie_word_embeddings:
        assert isinstance(emb, PackedEmbedding)
        assert emb(ids).dtype == torch.float32
        torch.testing.assert_close(emb(ids), ref.model.get_input_embeddings()(ids), atol=0, rtol=0)
    torch.testing.assert_close(_logits(bf16, ids), _logits(ref, ids), atol=1e-6, rtol=1e-6)
    with kernels.force("packed_gemm", "kernel"):
        fp32 = StackedLoRA(_tiny(), [adapter, None], ["a", "base"])
    assert not torch.equal(_logits(bf16, ids), _logits(fp32, ids))  # the rounding is real


def test_bf16_weights_without_the_kernel_run_torch_bf16(monkeypatch):
    """Where the packed kernel is off, bf16 weights mean a bf16 model on torch's matmuls."""
    monkeypatch.setenv("SCPDR_GEMM_KERNEL", "0")
    model = _tiny()
    adapter = testing.random_lora_adapter(model, "model.layers.0.self_attn.v_proj", rank=2)
    stack = StackedLoRA(model, [adapter, None], ["a", "base"], weight_dtype=torch.bfloat16)
    assert next(stack.model.parameters()).dtype == torch.bfloat16
    out = _logits(stack, torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("rows", [1, 3, 6, 24])
def test_bf16_torch_layers_run_plain_linear(rows):
    """Without the kernel, a bf16 layer runs ``F.linear`` at every row count: no input chunks
    for a wide weight and no few-rows ``(W·xᵀ)ᵀ`` form (both measured slower in bf16 on AMD and
    Intel), so its output is F.linear's bit for bit; the LoRA delta is added on top."""
    gen = torch.Generator().manual_seed(rows)
    n_in, n_out, rank = 1200, 40, 3
    base = torch.nn.Linear(n_in, n_out, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(n_out, n_in, generator=gen))
    a = torch.randn(1, n_in, rank, generator=gen).to(torch.bfloat16)
    b = torch.randn(1, rank, n_out, generator=gen).to(torch.bfloat16)
    mode = GroupMode()
    mode.stacked = 1
    lin = StackedLoraLinear(base, a, b, mode)
    assert lin.weight_chunks is None and lin.base_layer is base
    x = torch.randn(rows, n_in, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
        plain = torch.nn.functional.linear(x, base.weight, base.bias)
        expected = plain.clone().view(1, rows, n_out)
        expected[:1].baddbmm_(torch.bmm(x.view(1, rows, n_in), a), b)
    assert torch.equal(y, expected.view(rows, n_out))


def test_bf16_without_the_kernel_rounds_the_weights_read_from_the_checkpoint(monkeypatch, tmp_path):
    """On torch's bf16 matmuls the weights are rounded from the checkpoint's tensors (so that the
    model's own memory-mapped float32 weights are not all paged in): every 2-D weight is, bit for
    bit, its checkpoint tensor rounded to bf16 where that tensor matches the module on the
    compared rows (a row it does not compare shows which was used), and the module's own
    rounded weight where it does not."""
    from transformers import AutoModelForCausalLM

    from scpdr.lora import checkpoint_weight_source

    monkeypatch.setenv("SCPDR_GEMM_KERNEL", "0")
    _tiny().save_pretrained(str(tmp_path))
    read = checkpoint_weight_source(tmp_path)

    def marked(name):  # row 1 is not among the rows compared (0, middle, last) for >= 4 rows
        t = read(name)
        if t is not None and t.dim() == 2 and t.shape[0] >= 4:
            t = t.clone()
            t[1] += 1.0
        return t

    def wrong(name):  # every row differs: never used
        t = read(name)
        return None if t is None else t + 1.0

    for source, used in ((marked, True), (wrong, False)):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
        own = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        adapter = testing.random_lora_adapter(model, "model.layers.0.mlp.up_proj", rank=2)
        stack = StackedLoRA(
            model, [adapter, None], ["a", "base"], weight_source=source,
            weight_dtype=torch.bfloat16,
        )  # fmt: skip
        got = stack.model.state_dict()
        checked = 0
        for k, v in own.items():
            if not k.endswith("weight") or v.dim() != 2:
                continue
            name = k[: -len(".weight")]
            t = got.get(k)
            if t is None:  # the wrapped linear's base layer
                t = stack.model.get_submodule(name).weight
            expected = v.clone()
            tied = name == "lm_head" and model.config.tie_word_embeddings
            src = read("model.embed_tokens" if tied else name)  # a tied head: the embeddings
            if used and src is not None and v.shape[0] >= 4:
                expected[1] = (src[1] + 1.0).to(torch.bfloat16)
                checked += 1
            assert t.dtype == torch.bfloat16 and torch.equal(t, expected), k
        assert checked >= 5 if used else checked == 0  # q, k, v, o, gate, up, down, embeddings


def test_serve_precision_option():
    """--precision: auto (here the suite's SCPDR_PRECISION=fp32: the checkpoint's float32), fp32
    or bf16; anything else is refused naming the option."""
    assert ServeConfig().model_dtype() is None
    assert ServeConfig(precision="bf16").model_dtype() == torch.bfloat16
    assert ServeConfig(precision="fp32").model_dtype() == torch.float32
    with pytest.raises(ConfigError, match="precision"):
        ServeConfig(precision="fp16")


@needs_kernel
def test_from_bundle_in_bf16_on_cpu_keeps_bf16_panels(tmp_path):
    """ProtectedLM.from_bundle(dtype=bf16) on CPU (``scpdr serve --precision bf16``): the LoRA
    bundle's base loads in float32 and its linears keep bf16 panels on the kernel; the protected
    model generates with finite charges, its first token and its log-prob those of the float32
    load up to the rounding of the weights."""
    from scpdr import models
    from scpdr.lora import save_random_lora
    from scpdr.runtime import ProtectedLM

    tok = testing.tiny_tokenizer()
    base = testing.tiny_model(0)
    base.save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    refs = [
        save_random_lora(base, tmp_path / f"adapter-{i}", base_ref="../base", seed=i, std=0.3)
        for i in range(2)
    ]
    bundle = models.write_bundle(tmp_path / "bundle", base=tmp_path / "base", constituents=refs)
    with kernels.force("packed_gemm", "kernel"):
        lm = ProtectedLM.from_bundle(bundle, dtype=torch.bfloat16, device="cpu")
        fp32 = ProtectedLM.from_bundle(bundle, device="cpu")
    assert lm.fast_path.on
    dtypes = {
        m.weight_packed.dtype for m in lm.runner.model.modules() if isinstance(m, StackedLoraLinear)
    }
    assert dtypes == {torch.bfloat16}
    out = lm.generate(["My secret code is"], max_new_tokens=4, stop_at_eos=False)
    ref = fp32.generate(["My secret code is"], max_new_tokens=4, stop_at_eos=False)
    assert len(out[0].token_ids) == 4
    assert all(math.isfinite(c) for c in [*out[0].cost, *out[0].logprobs])
    assert out[0].token_ids[0] == ref[0].token_ids[0]
    assert abs(out[0].logprobs[0] - ref[0].logprobs[0]) < 0.05  # bf16 rounding of the weights
