"""The lean one-token decoding step (scpdr.runtime.decode_step) in both runners: bitwise the
model's own forward, step after step, with padding, rows leaving the batch, and (shared-base
stack) both the packed kernel's and torch's linears; anything but a plain Llama with SDPA keeps
its forward."""

from __future__ import annotations

import itertools

import pytest
import torch

from scpdr import kernels, models, testing
from scpdr.lora import StackedLoRA, read_lora_adapter, save_random_lora
from scpdr.runtime.decode_step import llama_decode_step
from scpdr.runtime.runner import PerModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["My secret code is", "Hello there, how are you doing today", "x"]
PACKED = kernels.gemm.library() is not None and kernels.gemm.library().tiled


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-step")
    tok = testing.tiny_tokenizer()
    base = testing.tiny_model(0)
    base.save_pretrained(str(root / "base"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kw = {"base_ref": "../base", "alpha": 8, "target_modules": targets, "std": 0.3}
    refs = [save_random_lora(base, root / f"a{i}", r=4 + 2 * i, seed=i, **kw) for i in range(2)]
    return root / "base", refs, tok


def _stack(parts, lean: bool) -> StackedLoRA:
    base, refs, _ = parts
    adapters = [read_lora_adapter(r) for r in refs]
    stack = StackedLoRA(models.load_model(base), [*adapters, None], ["a0", "a1", "base"])
    if not lean:
        stack.decode_step = None
    return stack


@pytest.mark.parametrize(
    "gemm",
    ["torch", pytest.param("kernel", marks=pytest.mark.skipif(not PACKED, reason="no kernel"))],
)
def test_lean_steps_are_bitwise_the_models_forward(parts, gemm):
    """Prefill three left-padded prompts, then 6 greedy steps; after the third, the middle row
    leaves the batch (the stacked cache selects it out of every group). Each step's logits of
    the lean step equal the model's forward exactly."""
    tok = parts[2]
    with kernels.force("packed_gemm", gemm):
        lean, plain = _stack(parts, True), _stack(parts, False)
    assert lean.decode_step is not None
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = [s.new_caches() for s in (lean, plain)]
    pairs = list(zip((lean, plain), caches, strict=True))
    with torch.inference_mode():
        outs = [s(enc["input_ids"], mask, pos, c, keep=1) for s, c in pairs]
        assert torch.equal(*outs)
        pos = pos[:, -1:]
        for step in range(6):
            ids = outs[0][0, :, -1].argmax(-1, keepdim=True)  # group 0's greedy tokens (B, 1)
            mask, pos = torch.cat([mask, torch.ones_like(ids)], 1), pos + 1
            outs = [s(ids, mask, pos, c, keep=1) for s, c in pairs]
            assert outs[0].shape == (3, mask.shape[0], 1, 49152)
            assert torch.equal(*outs), f"step {step}"
            if step == 2:  # the middle row finishes
                keep = torch.tensor([0, 2])
                for c in caches:
                    c[0].batch_select_indices(keep)
                mask, pos, outs = mask[keep], pos[keep], [o[:, keep] for o in outs]


def test_the_per_model_runner_steps_are_bitwise_each_models_forward(parts):
    """PerModelRunner over two models (the base and another tiny model): 5 greedy steps of two
    left-padded prompts, the lean steps against each model's forward."""
    tok = parts[2]

    def runner(lean: bool) -> PerModelRunner:
        ms = [models.load_model(parts[0]), testing.tiny_model(7)]
        r = PerModelRunner(ms, ["a", "b"], vocab_size=49152)
        if not lean:
            r.decode_steps = [None, None]
            r.heads = [None, None]  # each model's own forward
        return r

    lean, plain = runner(True), runner(False)
    assert all(s is not None for s in lean.decode_steps)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    pairs = [(r, r.new_caches()) for r in (lean, plain)]
    with torch.inference_mode():
        outs = [r(enc["input_ids"], mask, pos, c, keep=1) for r, c in pairs]
        pos = pos[:, -1:]
        for step in range(5):
            ids = outs[1][1, :, -1].argmax(-1, keepdim=True)
            mask, pos = torch.cat([mask, torch.ones_like(ids)], 1), pos + 1
            outs = [r(ids, mask, pos, c, keep=1) for r, c in pairs]
            assert outs[0].shape == (2, 2, 1, 49152)
            assert torch.equal(*outs), f"step {step}"


def test_a_one_token_prompt_prefills_through_the_lean_step(parts):
    """A one-token prompt's prefill is a one-token forward with an empty cache: the lean step
    fills it as the forward would."""
    tok = parts[2]
    lean, plain = _stack(parts, True), _stack(parts, False)
    ids = torch.tensor([[tok.bos_token_id or 1]])
    mask, pos = torch.ones_like(ids), torch.zeros_like(ids)
    caches = [lean.new_caches(), plain.new_caches()]
    with torch.inference_mode():
        a, b = (s(ids, mask, pos, c, keep=1) for s, c in zip((lean, plain), caches, strict=True))
        assert torch.equal(a, b)
        nxt = a[0, :, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        a, b = (
            s(nxt, mask, pos + 1, c, keep=1) for s, c in zip((lean, plain), caches, strict=True)
        )
        assert torch.equal(a, b)


def test_the_lean_step_refuses_more_than_one_new_token(parts):
    step = _stack(parts, True).decode_step
    ids = torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="one new token per row"):
        step(ids, torch.ones_like(ids), torch.zeros_like(ids), None)


def test_other_models_keep_their_own_forward(parts):
    """Eager attention, a subclass of the Llama classes and a non-Llama model get no lean step
    (their forward is used for every call)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    base = parts[0]
    assert llama_decode_step(models.load_model(base)) is not None
    eager = LlamaForCausalLM.from_pretrained(str(base), attn_implementation="eager")
    assert llama_decode_step(eager) is None

    class Custom(LlamaForCausalLM):
        pass

    assert llama_decode_step(Custom(testing.tiny_config())) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64))
    assert llama_decode_step(gpt2) is None


def test_the_per_model_runners_head_path_is_bitwise_each_models_forward(parts):
    """Where the runner computes a Llama model's logits itself (decoder, then its head into the
    one output buffer), they equal the model's forward exactly: every kept-positions form
    (all, the last, a bool mask, one position per row), with and without a cache, float32 and
    bf16 (converted into the float32 buffer); a hooked head keeps the forward."""
    from scpdr.runtime.runner import llama_head

    tok = parts[2]
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    keeps = [
        0,
        1,
        torch.cat([valid, valid.new_zeros(len(PROMPTS), 1)], 1),
        mask.sum(-1, keepdim=True) - 1,
    ]
    for dtype in (torch.float32, torch.bfloat16):
        ms = [models.load_model(parts[0], dtype=dtype), testing.tiny_model(7).to(dtype)]
        fast = PerModelRunner(ms, ["a", "b"], vocab_size=49152)
        plain = PerModelRunner(ms, ["a", "b"], vocab_size=49152)
        assert all(h is not None for h in fast.heads)
        plain.heads = [None, None]
        with torch.inference_mode():
            for keep in keeps:
                for cached in (False, True):
                    caches = [r.new_caches() if cached else None for r in (fast, plain)]
                    a, b = (
                        r(ids, mask, pos, c, keep=keep)
                        for r, c in zip((fast, plain), caches, strict=True)
                    )
                    assert a.dtype == torch.float32 and a.shape == b.shape
                    assert torch.equal(a, b), (
                        dtype,
                        keep if isinstance(keep, int) else keep.shape,
                        cached,
                    )
        # the protocol's out: the logits written into a buffer large enough, else a new tensor
        with torch.inference_mode():
            ref = plain(ids, mask, pos, None, keep=keeps[2])
            buf, small = torch.full((ref.numel() + 7,), torch.nan), torch.empty(ref.numel() - 1)
            for r in (fast, plain):
                got = r(ids, mask, pos, None, keep=keeps[2], out=buf)
                assert got.data_ptr() == buf.data_ptr() and torch.equal(got, ref)
                other = r(ids, mask, pos, None, keep=keeps[2], out=small)
                assert other.data_ptr() != small.data_ptr() and torch.equal(other, ref)
    hooked = testing.tiny_model(3)
    hooked.lm_head.register_forward_hook(lambda m, i, o: o + 1)
    assert llama_head(hooked) is None and llama_head(testing.tiny_model(3)) is not None


def test_the_per_model_runners_heads_in_two_steps_are_its_logits(parts):
    """``hidden_states`` then ``project_heads`` give exactly the runner's logits at a bool
    ``keep``, float32 and bf16, and over slices of the positions (what teacher-forced scoring
    does, chunk by chunk) the same up to the head matmul's rounding over another row count; a
    runner that does not run every head says so and refuses."""
    ids, mask, pos, keep = _scoring_batch(parts[2])
    n = int(keep.sum())
    for dtype in (torch.float32, torch.bfloat16):
        ms = [models.load_model(parts[0], dtype=dtype), testing.tiny_model(7)]
        runner = PerModelRunner(ms, ["a", "b"], vocab_size=49152)
        assert runner.splits_heads
        with torch.inference_mode():
            ref = runner(ids, mask, pos, None, keep=keep)  # (G, N, V)
            hidden = runner.hidden_states(ids, mask, pos, keep)
            assert [tuple(h.shape) for h in hidden] == [(n, 32)] * 2
            for a, b in _slices(n):
                out = torch.full((2, b - a, 49152), torch.nan)
                got = runner.project_heads([h[a:b] for h in hidden], out)
                assert got is out, (dtype, a, b)
                if b - a == n:
                    assert torch.equal(got, ref), dtype
                tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # the head's dtype's rounding
                torch.testing.assert_close(got, ref[:, a:b], rtol=tol, atol=tol)
        runner.heads[1] = None
        assert not runner.splits_heads
        with pytest.raises(ValueError, match="'b'"):
            runner.hidden_states(ids, mask, pos, keep)


def test_the_shared_base_runners_heads_in_two_steps_are_its_logits(parts):
    """The same for the LoRA stack: one stacked decoder forward, then the stacked head over
    any slices of the positions, give its logits at a bool ``keep`` (up to the head's
    rounding over another row count); a hooked base is not split."""
    ids, mask, pos, keep = _scoring_batch(parts[2])
    n = int(keep.sum())
    stack = _stack(parts, lean=True)
    assert stack.splits_heads
    with torch.inference_mode():
        ref = stack(ids, mask, pos, None, keep=keep)  # (G, N, V)
        hidden = stack.hidden_states(ids, mask, pos, keep)
        assert [tuple(h.shape) for h in hidden] == [(n, 32)] * 3
        for a, b in _slices(n):
            got = stack.project_heads([h[a:b] for h in hidden])
            assert got.dtype == torch.float32 and got.shape == (3, b - a, 49152)
            torch.testing.assert_close(got, ref[:, a:b], rtol=1e-5, atol=1e-5)
    hook = stack.model.register_forward_hook(lambda *args: None)
    assert not stack.splits_heads
    with pytest.raises(ValueError, match="not a plain Llama"):
        stack.hidden_states(ids, mask, pos, keep)
    hook.remove()


def _scoring_batch(tok):
    """Left-padded ``PROMPTS`` as teacher-forced scoring runs them: ``(ids, mask, position
    ids, keep)``, ``keep`` the bool ``(B, T)`` positions predicting a real target."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    return ids, mask, pos, torch.cat([valid, valid.new_zeros(len(PROMPTS), 1)], 1)


def _slices(n):
    """``(a, b)`` slices of n positions: all, then 1 + the rest, then three pieces."""
    for cuts in ([0, n], [0, 1, n], [0, 3, n - 2, n]):
        yield from itertools.pairwise(cuts)
