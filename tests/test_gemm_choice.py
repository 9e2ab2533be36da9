"""How the packed kernel's part in a stack is chosen (:mod:`scpdr.lora.gemm_choice`): the rule
that weighs the decode steps of batch 1 and 8 together, and a GGUF base's Q4_1 blocks taken on
the kernel also where its float32 panels lose to torch.

The timings are this file's input: ``time_layers`` (the one function every measurement of the
choice runs through) is replaced by a machine whose sides take fixed times, so each decision is
the one those timings call for. The layers themselves run for real.
"""

from __future__ import annotations

import pytest
import torch

from scpdr import kernels, testing
from scpdr.kernels.q4 import dequantize_blocks
from scpdr.lora import StackedLoRA, StackedLoraLinear, choose_stack_kernel, pack_full_model
from scpdr.lora.gemm_choice import StackKernel, gains_outweigh_losses

GEMM = kernels.gemm.library()
needs_kernel = pytest.mark.skipif(
    GEMM is None or not GEMM.tiled, reason="no C compiler: no packed kernel here"
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: seconds per pass of each side at 3 and 24 rows (G = 3 groups: batch 1 and 8) and 1 and 8
#: rows (one group). "kernel"/"float32": float32 panels, "q4": Q4_1 blocks, "torch": torch's.
PANELS_LOSE = {  # panels 0.9x torch at both batch sizes; blocks 1.8x and 1.125x torch
    "kernel": (1.0, 1.0), "float32": (1.0, 1.0), "torch": (0.9, 0.9), "q4": (0.5, 0.8),
}  # fmt: skip
EMERALD_RAPIDS = {  # the near-tie measured there: panels 1.6x torch at 3 rows, 0.98x at 24
    "kernel": (1.0, 1.0), "float32": (1.0, 1.0), "torch": (1.6, 0.98), "q4": (0.55, 0.75),
}  # fmt: skip
BLOCKS_LOSE = {"kernel": (1.0, 1.0), "float32": (1.0, 1.0), "torch": (0.9, 0.9), "q4": (1.2, 1.2)}


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty ``$SCPDR_HOME`` and no side forced; returns a setter of the machine's timings."""
    import scpdr.lora.gemm_choice as choice

    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.delenv("SCPDR_GEMM_KERNEL", raising=False)
    kernels.reset()
    times: dict[str, tuple[float, float]] = {}

    def fake(sides, rows, *, repeats, before=None):
        few = rows <= 3  # the decode step of batch 1 (G or fewer rows), else batch 8 or more
        return {side: times.get(side, (1.0, 1.0))[0 if few else 1] for side in sides}

    monkeypatch.setattr(choice, "time_layers", fake)
    yield times.update
    kernels.reset()


@pytest.mark.parametrize(
    ("speedups", "taken"),
    [
        ((1.6, 0.98), True),  # the kernel on panels, Intel Xeon (Emerald Rapids)
        ((1.5, 0.94), True),  # Q4_1 blocks over panels, x86-64-v3 build on Cascade Lake
        ((1.3, 0.63), False),  # the gain does not pay for the loss
        ((1.05, 0.9), False),
        ((1.0, 1.0), False),  # no gain: the reference stays
        ((1.1, 1.1), True),
    ],
)
def test_gains_outweigh_losses(speedups, taken):
    """The rule weighs batch 1 and 8 alike: the speedups (reference / candidate) multiply to
    more than 1."""
    cases = [(f"at {r} rows", 1.0, s) for r, s in zip((3, 24), speedups, strict=True)]
    assert gains_outweigh_losses(cases) is taken
    assert gains_outweigh_losses([]) is False


@needs_kernel
def test_a_near_tie_at_batch_8_keeps_the_kernel(machine):
    """Panels 1.6x torch at batch 1 and 0.98x at batch 8: the kernel (the rule before asked it
    to win at both and gave a protected step on torch 2.5x slower at batch 1)."""
    machine(EMERALD_RAPIDS)
    shapes = [(64, 64, 4), (64, 96, 4), (96, 64, 0)]
    stack = choose_stack_kernel(shapes, shapes, groups=3, lora=2)
    assert stack == StackKernel(kernels.gemm.library(), panels=True, q4=True)


@needs_kernel
def test_blocks_run_on_the_kernel_where_panels_lose_to_torch(machine):
    """Panels slower than torch at both batch sizes, blocks faster than both: the linears with
    blocks run on the kernel, the others on torch; without blocks, all on torch."""
    machine(PANELS_LOSE)
    shapes = [(64, 64, 4), (64, 96, 4), (96, 64, 0)]
    stack = choose_stack_kernel(shapes, shapes[:2], groups=3, lora=2)
    lib = kernels.gemm.library()
    assert stack == StackKernel(lib, panels=False, q4=True)
    assert stack.for_layer(True) is lib and stack.for_layer(False) is None
    assert choose_stack_kernel(shapes, groups=3, lora=2) == StackKernel()
    with kernels.force("packed_gemm", "torch"):
        assert choose_stack_kernel(shapes, shapes, groups=3, lora=2) == StackKernel()


@needs_kernel
def test_blocks_slower_than_torch_stay_off(machine):
    machine(BLOCKS_LOSE)
    shapes = [(64, 64, 4)]
    assert choose_stack_kernel(shapes, shapes, groups=3, lora=2) == StackKernel()


def _q4_model(seed: int):
    """A tiny Llama whose decoder linears hold the dequantized weights of random Q4_1 blocks,
    and the blocks by module name (the head, tied to the embeddings, has none)."""
    model = testing.tiny_model(seed, hidden_size=64, intermediate_size=96, num_layers=1)
    gen = torch.Generator().manual_seed(seed)
    blocks = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers." in name:
            blocks[name] = testing.random_q4_blocks(gen, mod.out_features, mod.in_features)
            with torch.no_grad():
                mod.weight.copy_(dequantize_blocks(blocks[name]))
    return model, blocks


@needs_kernel
def test_a_stack_over_blocks_where_panels_lose(machine):
    """A LoRA stack over a GGUF-like base on the machine where panels lose to torch: its
    projections on their Q4_1 blocks on the kernel, the head on torch's matmuls; the logits
    those of the stack on torch."""
    machine(PANELS_LOSE)
    model, blocks = _q4_model(1)
    target = "model.layers.0.self_attn.q_proj"
    adapter = testing.random_lora_adapter(model, target, rank=4, scale=0.1)
    ids = torch.tensor([[1, 504, 3, 9007, 28]])
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    ref = StackedLoRA(_q4_model(1)[0], [adapter, None], ["a", "base"], use_kernel=False)
    stack = StackedLoRA(model, [adapter, None], ["a", "base"], q4_source=blocks.get)
    wrapped = {n: m for n, m in stack.model.named_modules() if isinstance(m, StackedLoraLinear)}
    assert {wrapped[n].weight_format for n in blocks} == {"q4_1"}
    head = [m for n, m in wrapped.items() if n not in blocks]
    assert head and all(m.weight_packed is None for m in head)  # on torch
    with torch.inference_mode():
        got, want = stack(ids, mask, pos), ref(ids, mask, pos)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-4)


@needs_kernel
def test_a_full_model_decodes_from_its_blocks_where_panels_lose(machine):
    """pack_full_model on the same machine: the linears with blocks on the kernel (the rule
    before needed the panels to beat torch first), the logits those of the plain model."""
    machine(PANELS_LOSE)
    model, blocks = _q4_model(2)
    ids = torch.tensor([[1, 504, 3, 9007, 28]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    assert pack_full_model("tiny", model, q4_source=blocks.get)
    formats = {m.weight_format for m in model.modules() if isinstance(m, StackedLoraLinear)}
    assert formats == {"q4_1"}
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-3, rtol=1e-4)


@needs_kernel
def test_a_full_model_stays_as_it_is_where_blocks_lose(machine):
    machine(BLOCKS_LOSE)
    model, blocks = _q4_model(2)
    assert not pack_full_model("tiny", model, q4_source=blocks.get)
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())
