"""The packed kernel beyond LoRA stacks: the full models of the general path
(:func:`scpdr.lora.pack_full_model`), and calls of many rows that run torch's matmuls on the
panels (:func:`scpdr.kernels.gemm.lora_linear_torch`, chosen by
:func:`scpdr.lora.choose_torch_rows`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scpdr import kernels, testing
from scpdr.kernels.gemm import lora_linear_reference, lora_linear_torch, pack_panels
from scpdr.kernels.q4 import dequantize_blocks
from scpdr.lora import GroupMode, StackedLoraLinear, choose_torch_rows, pack_full_model
from scpdr.lora.gemm_choice import MANY_ROWS

GEMM = kernels.gemm.library()
KERNEL = GEMM is not None and GEMM.tiled
needs_kernel = pytest.mark.skipif(not KERNEL, reason="no C compiler: no packed kernel here")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Log-probs of a tiny model (|logits| < 20) through ~64 roundings that may differ: the packed
#: kernel sums each dot product in another order than torch's sgemm.
ATOL = testing.f32_tol(20.0, ops=64)


def _blocks(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Random Q4_1 blocks ``(n, k / 32, 20)``: float16 scale and minimum, random nibbles."""
    d = (torch.rand(n, k // 32, generator=gen) * 0.05 + 1e-4).to(torch.float16)
    m = (-torch.rand(n, k // 32, generator=gen) * 0.4).to(torch.float16)
    qs = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    return torch.cat([torch.stack([d, m], dim=-1).view(torch.uint8), qs], dim=-1).contiguous()


def _q4_model(seed: int):
    """A tiny Llama whose linears (not the tied head) hold the weights of random Q4_1 blocks, as a
    model loaded from a GGUF file does, and those blocks by module name."""
    model = testing.tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod) is nn.Linear and name != "lm_head":
                blocks[name] = _blocks(gen, mod.out_features, mod.in_features)
                mod.weight.copy_(dequantize_blocks(blocks[name]))
    return model, blocks


def _prefill_and_decode(model, ids):
    """Logits of a prefill of ``ids`` and of 5 greedy KV-cached steps after it (the lean step
    the runners use), and the greedy tokens."""
    from scpdr.runtime.decode_step import llama_decode_step
    from scpdr.runtime.kv_cache import new_cache

    lean = llama_decode_step(model)
    assert lean is not None  # still transformers' Llama classes: the packed linears are leaves
    b, t = ids.shape
    cache = new_cache()
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        pre = model(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=cache)
        tok = pre.logits[:, -1:].argmax(-1)
        steps, toks = [], [tok]
        for i in range(5):
            mask = torch.ones(b, t + 1 + i, dtype=torch.long)
            logits = lean(tok, mask, torch.full((b, 1), t + i), cache)
            tok = logits[:, -1:].argmax(-1)
            steps.append(logits)
            toks.append(tok)
    return pre.logits, torch.cat(steps, 1), torch.cat(toks, 1)


@needs_kernel
def test_full_model_decodes_from_its_q4_blocks():
    """A full model whose linears are a GGUF file's Q4_1 blocks (the embedded base of the general
    path) decodes on the packed kernel from the blocks: every such linear packed as q4 panels,
    keeping the original; a prefill handed to torch is the plain model's bit for bit, the decode
    steps its values up to the order of additions, the same greedy tokens."""
    packed, blocks = _q4_model(3)
    plain, _ = _q4_model(3)
    with kernels.force("packed_gemm", "kernel"):
        assert pack_full_model("tiny", packed, q4_source=blocks.get)
    linears = [m for m in packed.modules() if isinstance(m, StackedLoraLinear)]
    assert len(linears) == len(blocks) and all(m.weight_format == "q4_1" for m in linears)
    assert all(torch.equal(m.weight, plain.get_submodule(n).weight) for n, m in
               ((n, packed.get_submodule(n)) for n in blocks))  # fmt: skip
    assert type(packed.lm_head) is nn.Linear  # no blocks: left as it was
    ids = torch.randint(3, 49152, (3, 9), generator=torch.Generator().manual_seed(0))
    for lin in linears:
        lin.torch_rows = 10  # a prefill of 27 rows on the original layers, the steps' 3 not
    pre_a, steps_a, toks_a = _prefill_and_decode(packed, ids)
    pre_b, steps_b, toks_b = _prefill_and_decode(plain, ids)
    assert torch.equal(pre_a, pre_b)
    torch.testing.assert_close(steps_a, steps_b, atol=ATOL, rtol=0)
    assert torch.equal(toks_a, toks_b)
    # which calls run what: with the kept original zeroed, 10 rows or more give zeros, fewer
    # the kernel's product of the blocks
    lin = linears[0]
    x = torch.randn(10, lin.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lin.base_layer.weight.zero_()
        torch.testing.assert_close(lin(x[:9]), x[:9] @ dequantize_blocks(blocks[_name(packed, lin)]).t(),
                                   atol=ATOL, rtol=0)  # fmt: skip
        assert not lin(x).any()


def _name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def test_full_model_is_left_alone_without_blocks_or_kernel(monkeypatch):
    """No GGUF blocks (a fine-tune saved as safetensors), blocks that are not the weights (a
    fine-tune of the GGUF base), or ``SCPDR_GEMM_KERNEL=0``: the model stays as loaded."""
    model, blocks = _q4_model(4)
    assert not pack_full_model("tiny", model)  # no GGUF file for this ref
    other, _ = _q4_model(5)
    with kernels.force("packed_gemm", "kernel"):
        assert not pack_full_model("tiny", other, q4_source=blocks.get)  # not its weights
    monkeypatch.setenv("SCPDR_GEMM_KERNEL", "0")
    assert not pack_full_model("tiny", model, q4_source=blocks.get)
    for m in (model, other):
        assert not any(isinstance(x, StackedLoraLinear) for x in m.modules())


@needs_kernel
@pytest.mark.parametrize("fmt", ["float32", "bf16", "q4_1"])
@pytest.mark.parametrize(("groups", "lora", "rows"), [(1, 0, 70), (3, 2, 40), (2, 2, 129)])
def test_many_rows_run_torchs_matmuls_on_the_panels(fmt, groups, lora, rows):
    """A packed layer told to hand calls of many rows to torch (``torch_rows``) computes the
    same linear from the same panels (bf16 and q4 ones widened exactly): the torch reference's
    values up to the order of additions, in stacked and single-group modes, with a bias and an
    output width off the panel width; below the threshold the kernel runs as before."""
    gen = torch.Generator().manual_seed(rows)
    n_in, n_out, rank = 96, 70, 5
    layer = nn.Linear(n_in, n_out, bias=True)
    q4 = None
    with torch.no_grad():
        if fmt == "q4_1":
            q4 = _blocks(gen, n_out, n_in)
            layer.weight.copy_(dequantize_blocks(q4))
        else:
            layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        layer.bias.copy_(torch.randn(n_out, generator=gen))
    a = torch.randn(lora, n_in, rank, generator=gen) if lora else None
    b = torch.randn(lora, rank, n_out, generator=gen) if lora else None
    mode = GroupMode()
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM, weight_dtype=dtype, q4=q4)
    assert lin.weight_format == fmt
    x = torch.randn(groups * rows, n_in, generator=gen)
    tol = {"atol": 2e-5 * n_in**0.5 * (1 + rank**0.5), "rtol": 1e-4}
    with torch.inference_mode():
        for stacked, single in ((groups, None), (None, 0)):
            mode.stacked, mode.single = stacked, single
            xs = x if stacked else x[:rows]
            lin.torch_rows = None
            kernel = lin(xs)
            lin.torch_rows = xs.shape[0]  # this call: torch's matmuls
            many = lin(xs)
            want = lin.reference_forward(xs)
            assert many.shape == want.shape == (xs.shape[0], n_out)
            torch.testing.assert_close(many, want, **tol)
            torch.testing.assert_close(kernel, want, **tol)
            lin.torch_rows = xs.shape[0] + 1  # one row short of it: the kernel's bits
            assert torch.equal(lin(xs), kernel)
    if fmt == "q4_1":  # the same floats as a float32 layer of the dequantized weight
        f32_mode = GroupMode()
        f32 = StackedLoraLinear(layer, a, b, f32_mode, gemm=GEMM)
        f32.torch_rows = lin.torch_rows = 1
        mode.stacked, mode.single = f32_mode.stacked, f32_mode.single = groups, None
        with torch.inference_mode():
            assert torch.equal(lin(x), f32(x))


def test_reference_and_torch_path_agree_on_the_deltas():
    """The deltas added after torch's matmuls are the reference's (one helper): a layer with
    zero base weights gives exactly the deltas the reference gives."""
    gen = torch.Generator().manual_seed(0)
    w = pack_panels(torch.zeros(40, 64), 16)
    la = torch.stack([pack_panels(torch.randn(3, 64, generator=gen), 16) for _ in range(2)])
    lb = torch.stack([pack_panels(torch.randn(40, 3, generator=gen), 16) for _ in range(2)])
    x = torch.randn(3 * 7, 64, generator=gen)
    kw = {"groups": 3, "lora_a": la, "lora_b": lb, "first": 0, "lora": 2, "rank": 3}
    got = lora_linear_torch(x, w, 40, **kw)
    want = lora_linear_reference(x, w, 40, **kw)
    assert torch.equal(got[14:], torch.zeros(7, 40))  # the third group: no delta
    assert got[:14].abs().min() > 0
    assert torch.equal(got, want)


@needs_kernel
def test_choose_torch_rows_is_measured_once_and_forced_off():
    """Forced on (``SCPDR_GEMM_KERNEL=1``) the kernel runs every call; otherwise torch from one
    of the measured row counts (or never), the same answer when asked again (remembered)."""
    shapes = [(96, 70, 0), (64, 64, 0)]
    with kernels.force("packed_gemm", "kernel"):
        assert choose_torch_rows(GEMM, shapes, groups=1, lora=0) is None
    first = choose_torch_rows(GEMM, shapes, groups=1, lora=0)
    assert first is None or first in MANY_ROWS
    assert choose_torch_rows(GEMM, shapes, groups=1, lora=0) == first
    # a stack of 40 groups decodes batch 8 in 320 rows: never handed to torch at a decode size
    assert choose_torch_rows(GEMM, shapes, groups=40, lora=0) is None


@pytest.mark.slow
@needs_kernel
def test_embedded_model_of_a_general_path_bundle_decodes_from_its_blocks(tmp_path):
    """On the embedded SmolLM2-135M loaded by ``from_bundle`` on the general path: its 210
    projections decode from their Q4_1 blocks (the tied head keeps torch), and the protected
    model generates the same tokens as the plain model, its log-probs up to rounding."""
    from scpdr import models
    from scpdr.runtime import ProtectedLM

    bundle = models.write_bundle(tmp_path / "bundle", base=None, constituents=[models.EMBEDDED])
    with kernels.force("packed_gemm", "kernel"):
        lm = ProtectedLM.from_bundle(bundle, method="none")
    packed = [m for m in lm.constituents[0].modules() if isinstance(m, StackedLoraLinear)]
    assert len(packed) == 210 and {m.weight_format for m in packed} == {"q4_1"}
    plain = ProtectedLM([models.load_base()[0]], lm.tokenizer, method="none")
    prompts = ["Write a haiku about the sea.", "What is 2 + 2?"]
    got = lm.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    want = plain.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-3, rtol=0
        )


@pytest.mark.slow
@needs_kernel
def test_the_attacks_model_store_loads_the_embedded_model_as_serve_does():
    """``scpdr eval``/``experiment`` load through :class:`scpdr.attacks.ModelStore`: the
    embedded model decodes from its Q4_1 blocks there too (what the attacks query is what
    ``scpdr serve`` serves), once per store, and a bf16 load is left as it is."""
    from scpdr import models
    from scpdr.attacks import ModelStore

    store = ModelStore()
    with kernels.force("packed_gemm", "kernel"):
        model = store.model(models.EMBEDDED)
        assert store.model(models.EMBEDDED) is model
        packed = [m for m in model.modules() if isinstance(m, StackedLoraLinear)]
        assert len(packed) == 210 and {m.weight_format for m in packed} == {"q4_1"}
        half = store.model(models.EMBEDDED, dtype=torch.bfloat16)
        assert not any(isinstance(m, StackedLoraLinear) for m in half.modules())
