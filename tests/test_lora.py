"""The shared-base LoRA fast path (scpdr.lora) against the general path on tiny real models.

The general path loads every adapter merged into its own copy of the base (scpdr.models), one
forward per model; the fast path runs base + K adapters as one stacked batch. Every method must
give the same log-probs (to float32 rounding: ATOL), certificates and greedy tokens, batched
with padding; anything the fast path does not support must fall back with a logged reason.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr import kernels, methods, models, testing
from scpdr.kernels.gemm import pack_panels, unpack_panels
from scpdr.lora import (
    GroupMode,
    LoraAdapter,
    PackedEmbedding,
    StackedLoRA,
    StackedLoraLinear,
    UnsupportedAdapterError,
    checkpoint_weight_source,
    read_lora_adapter,
    save_random_lora,
    stacked_from_bundle,
)
from scpdr.runtime import ProtectedLM

#: the packed C kernel, where it builds here with a register tile for this ISA (else the fast
#: path uses torch's matmuls); the tests below force it on where they test it
GEMM = kernels.gemm.library()
KERNEL = GEMM is not None and GEMM.tiled
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (r, alpha, targets, rslora) of the three adapters: different ranks, different target sets,
# lm_head on a tied-embedding model, rsLoRA scaling.
ADAPTERS = [
    (8, 16, [*PROJ, "lm_head"], False),
    (4, 8, ["q_proj", "v_proj", "lm_head"], False),
    (6, 12, PROJ, True),
]
PROMPTS = ["My secret code is", "Hello there, how are you doing today", "x"]
MAX_NEW = [4, 7, 5]  # rows finish at different steps: the stacked cache drops rows mid-decode
#: The fast path (W·x + s·B(A·x), stacked groups, the packed kernel) and the general path ((W +
#: s·BA)·x, one model at a time) round differently in every layer: log-probs (|log p| <= 20, the
#: e^-20 floor) agree to 64 float32 ulps of 20 (2 layers × 4 reductions × 2 ulps, × 2 through
#: log-softmax, × 2 through the rule), 1.5e-4.
ATOL = testing.f32_tol(20.0, ops=64)
VARIANT = {"model": "b", "constant": "c", None: None}
# (rule, variant) of every aggregating result row but "none" (one model: no fast path)
SPECS = [s for s in methods.SPECS.values() if s.kind == "aggregate" and s.rule != "none"]
CONFIGS = [(s.rule, VARIANT[s.base]) for s in SPECS]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny base, three random LoRA adapters over it, a bundle of all three (with a constant
    base vector), and the general path's models (each adapter merged into its own base copy)."""
    root = tmp_path_factory.mktemp("lora")
    tok = testing.tiny_tokenizer()
    base = testing.tiny_model(0)
    base.save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    refs = []
    for i, (r, alpha, targets, rs) in enumerate(ADAPTERS):
        refs.append(
            save_random_lora(
                base,
                root / f"adapter-{i}",
                base_ref="../base",
                r=r,
                alpha=alpha,
                target_modules=targets,
                seed=i,
                std=0.3,
                use_rslora=rs,
            )
        )
    vec = models.constant_base_vector(base, tok, testing.HELD_OUT_PROMPTS)
    bundle = models.write_bundle(
        root / "bundle", base=root / "base", constituents=refs, constant_base=vec
    )
    merged = [models.load_model(r) for r in refs]
    return {
        "root": root,
        "tok": tok,
        "base": base,
        "refs": refs,
        "vec": vec,
        "bundle": bundle,
        "merged": merged,
    }


@pytest.fixture(scope="module")
def stacks(lora):
    """Fast-path stacks per K: with the base group last ('b') and without it (methods without
    a base, and 'c'). (ProtectedLM.from_bundle builds the same: see the from_bundle tests.)"""
    out = {}
    for k in (2, 3):
        adapters = [read_lora_adapter(r) for r in lora["refs"][:k]]
        names = [f"adapter-{i}" for i in range(k)]
        base = lora["root"] / "base"
        out[k, "b"] = StackedLoRA(models.load_model(base), [*adapters, None], [*names, "base"])
        out[k, None] = StackedLoRA(models.load_model(base), adapters, names)
    return out


def _manifest(base, constituents):
    """An in-memory bundle manifest (stacked_from_bundle only reads its refs)."""
    return models.BundleManifest(
        base=str(base),
        constituents=[str(c) for c in constituents],
        tokenizer=str(base),
        vocab_hash="-",
        vocab_size=49152,
    )


def _general(lora, k, method, variant):
    base = {"b": {"base_model": lora["base"]}, "c": {"base_vector": lora["vec"]}}.get(variant, {})
    return ProtectedLM(lora["merged"][:k], lora["tok"], method=method, **base)


def _fast(lora, stacks, k, method, variant):
    stack = stacks[k, "b" if variant == "b" else None]
    vec = lora["vec"] if variant == "c" else None
    return ProtectedLM.from_runner(stack, lora["tok"], method=method, base_vector=vec)


def _encode(tok, side):
    return tok(PROMPTS, return_tensors="pt", padding=True, padding_side=side)


def _assert_same(fast, general, tok):
    assert fast.fast_path.on and not general.fast_path.on
    enc = _encode(tok, "right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ids0, mask0 = ids.clone(), mask.clone()
    a = fast.score(ids, mask, full=True, greedy=True, k_x=True, t_x=True)
    b = general.score(ids, mask, full=True, greedy=True, k_x=True, t_x=True)
    assert torch.equal(ids, ids0) and torch.equal(mask, mask0)  # inputs untouched
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(a.logprobs[valid], b.logprobs[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(a.k_x, b.k_x, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(a.t_x, b.t_x, atol=ATOL, rtol=1e-4)
    assert torch.equal(a.greedy, b.greedy)
    for side in ("left", "right"):
        enc = _encode(tok, side)
        torch.testing.assert_close(
            fast.next_token_logprobs(enc["input_ids"], enc["attention_mask"]),
            general.next_token_logprobs(enc["input_ids"], enc["attention_mask"]),
            atol=ATOL,
            rtol=0,
        )
    ga = fast.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_at_eos=False)
    gb = general.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_at_eos=False)
    assert [g.token_ids for g in ga] == [g.token_ids for g in gb]
    assert [len(g.token_ids) for g in ga] == MAX_NEW
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(torch.tensor(x.k_x), torch.tensor(y.k_x), atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------ equality


@pytest.mark.parametrize(
    ("k", "method", "variant"),
    [(2, method, variant) for method, variant in CONFIGS]
    + [(3, "cp-delta-r", None), (3, "scp-delta-r", "b"), (3, "scp-delta", "c")],
    ids=[f"2-{s.name}" for s in SPECS] + ["3-cp-delta-r", "3-scp-delta-r-b", "3-scp-delta-c"],
)
def test_fast_path_matches_general_path(lora, stacks, k, method, variant):
    fast = _fast(lora, stacks, k, method, variant)
    general = _general(lora, k, method, variant)
    assert fast.name == general.name and fast.num_constituents == k
    _assert_same(fast, general, lora["tok"])


@pytest.mark.parametrize(("method", "variant"), [("scp-delta-r", "b"), ("cp-fuse", None)])
def test_fast_path_scores_in_chunks_as_in_one(lora, stacks, method, variant):
    """The stack runs its decoder once and its stacked head (adapters on it included) chunk by
    chunk (``splits_heads``): chunks of one and of two rows score as one chunk, CP-Fuse's
    prompt-aware path included; a stack whose base is hooked (its forward not Llama's own)
    runs whole chunks, with the same score."""
    fast = _fast(lora, stacks, 2, method, variant)
    assert fast.runner.splits_heads
    enc = _encode(lora["tok"], "left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    kw = {"full": True, "t_x": True, "prompt_lengths": mask.sum(-1).clamp(max=2)}
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    ref = fast.score(ids, mask, **kw)
    g = 3 if variant else 2
    hook = None
    try:
        for split in (True, False):
            if not split:
                hook = fast.runner.model.register_forward_hook(lambda *args: None)
            assert fast.runner.splits_heads is split
            for elements in (1, 2 * ids.shape[1] * 49152 * g):
                fast.score_chunk_elements = elements
                got = fast.score(ids, mask, **kw)
                torch.testing.assert_close(
                    got.logprobs[valid], ref.logprobs[valid], atol=ATOL, rtol=0
                )
                torch.testing.assert_close(got.t_x, ref.t_x, atol=ATOL, rtol=1e-4)
    finally:
        if hook is not None:
            hook.remove()
    assert fast.runner.splits_heads


def test_from_bundle_detects_lora_constituents(lora, caplog):
    with caplog.at_level(logging.INFO, logger="scpdr.lora"):
        lm = ProtectedLM.from_bundle(lora["bundle"], method="scp-delta-r")
    assert "LoRA fast path on" in caplog.text
    assert lm.fast_path.on and "4 groups (3 with LoRA adapters)" in lm.fast_path.reason
    assert lm.runner.num_groups == 4 and lm.runner.num_lora == 3  # base group: no delta
    assert lm.name == "scp-delta-r-b" and lm.num_constituents == 3
    _assert_same(lm, _general(lora, 3, "scp-delta-r", "b"), lora["tok"])
    c = ProtectedLM.from_bundle(lora["bundle"], method="cp-delta-r")
    assert c.runner.num_groups == 3 and c.name == "cp-delta-r"
    _assert_same(c, _general(lora, 3, "cp-delta-r", None), lora["tok"])


def test_adapters_differ_and_views_equal_merged_models(lora, stacks):
    """Each group is its merged model (so the deltas are real and the groups distinct)."""
    stack = stacks[3, "b"]
    enc = _encode(lora["tok"], "right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    refs = [*lora["merged"], lora["base"]]
    with torch.inference_mode():
        out = stack(ids, mask, pos)  # (G, B, T, V)
        for g, model in enumerate(refs):
            want = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
            got = torch.log_softmax(out[g], -1)
            view = torch.log_softmax(stack.views[g](input_ids=ids, attention_mask=mask).logits, -1)
            m = mask.bool()
            torch.testing.assert_close(got[m], want[m], atol=ATOL, rtol=0)
            torch.testing.assert_close(view[m], want[m], atol=ATOL, rtol=0)
        lp = torch.log_softmax(out, -1)[:, mask.bool()]
        for g in range(3):  # every adapter moves its model away from the base and the others
            for h in range(g + 1, 4):
                assert (lp[g] - lp[h]).abs().max() > 0.5


def test_tied_lm_head_adapter_merges_like_peft_forward(lora):
    """The general path (merged adapter) equals PEFT's unmerged forward, where an lm_head LoRA
    on tied embeddings changes the output projection only."""
    from peft import PeftModel

    base = models.load_model(lora["root"] / "base")
    peft_model = PeftModel.from_pretrained(base, str(lora["refs"][0])).eval()
    ids = _encode(lora["tok"], "right")["input_ids"][:1]
    with torch.inference_mode():
        want = peft_model(input_ids=ids).logits
        got = lora["merged"][0](input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_sampling_matches_general_path(lora, stacks):
    fast = _fast(lora, stacks, 2, "scp-delta-r", "b")
    general = _general(lora, 2, "scp-delta-r", "b")
    kw = {"max_new_tokens": 6, "temperature": 0.9, "top_p": 0.95, "seed": [1, 2, 3]}
    a = fast.generate(PROMPTS, stop_at_eos=False, **kw)
    b = general.generate(PROMPTS, stop_at_eos=False, **kw)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


# ------------------------------------------------------------------------------ the layer


def _wrapped(stack):
    return [m for m in stack.model.modules() if isinstance(m, StackedLoraLinear)]


def _tiny_llama(seed, *, wide):
    # wide: down_proj has 1200 > CHUNK_IN_FEATURES inputs, so it is stored in input chunks
    inter = 1200 if wide else 24
    return testing.tiny_model(
        seed, hidden_size=16, intermediate_size=inter, num_layers=1, vocab_size=97
    )


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    plan=st.lists(
        st.one_of(
            st.none(), st.tuples(st.integers(1, 5), st.sets(st.sampled_from(PROJ), min_size=1))
        ),
        min_size=1,
        max_size=4,
    ),
    batch=st.integers(1, 3),
    tokens=st.sampled_from([1, 5]),
    wide=st.booleans(),
    use_kernel=st.booleans(),
)
def test_stacked_forward_equals_merged_weights(seed, plan, batch, tokens, wide, use_kernel):
    """Property: for any groups (None = the plain base; else rank and targets), the stacked
    forward and each group's view equal the base with W + s·B·A merged into its weights
    (zero-padding of smaller ranks and missing targets is exact), with the packed C kernel and
    with torch's matmuls (few-row and many-row kernels, chunked wide weights)."""
    import copy

    if all(p is None for p in plan):
        plan = [*plan, (2, {"q_proj"})]
    model = _tiny_llama(seed % 7, wide=wide)
    gen = torch.Generator().manual_seed(seed)
    named = dict(model.named_modules())
    groups, merged = [], []
    for i, p in enumerate(plan):
        ref = copy.deepcopy(model)
        if p is None:
            groups.append(None)
            merged.append(ref)
            continue
        r, targets = p
        mods = {}
        for name, layer in named.items():
            if name.rsplit(".", 1)[-1] in targets:
                a = torch.randn(r, layer.in_features, generator=gen) * 0.3
                b = torch.randn(layer.out_features, r, generator=gen) * 0.3
                s = 1.5 / r
                mods[name] = (a, b, s)
                with torch.no_grad():
                    ref.get_submodule(name).weight += s * b @ a
        groups.append(LoraAdapter(Path(f"g{i}"), "base", mods, {}))
        merged.append(ref)
    with kernels.force("packed_gemm", "kernel"):  # not measured: the packed layers tested
        stack = StackedLoRA(
            model, groups, [f"g{i}" for i in range(len(groups))], use_kernel=use_kernel
        )
    packed = [m.weight_packed is not None for m in _wrapped(stack)]
    assert all(packed) if use_kernel and KERNEL else not any(packed)
    ids = torch.randint(3, 97, (batch, tokens), generator=gen)
    mask = torch.ones_like(ids)
    if tokens > 1:
        mask[0, :2] = 0  # left padding in row 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        out = stack(ids, mask, pos)  # (G, B, T, V)
        for g, ref in enumerate(merged):
            kw = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
            want = ref(**kw).logits[mask.bool()]
            torch.testing.assert_close(out[g][mask.bool()], want, atol=1e-4, rtol=1e-4)
            view = stack.views[g](**kw).logits[mask.bool()]
            torch.testing.assert_close(view, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["packed", "torch"])
def test_wide_weights_from_checkpoint_source(tmp_path, use_kernel):
    """Re-laid-out weights (all, packed for the C kernel; wide ones, chunked for torch's
    matmuls) are read from the checkpoint (the model's own copy untouched); a source that
    disagrees with the loaded weights is ignored."""
    if use_kernel and not KERNEL:
        pytest.skip("no C compiler: the packed kernel cannot be built here")
    model = _tiny_llama(3, wide=True)
    model.save_pretrained(str(tmp_path / "m"))
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.0.mlp.down_proj"
    a = torch.randn(4, 1200, generator=gen) * 0.3
    b = torch.randn(16, 4, generator=gen) * 0.3
    ids = torch.randint(3, 97, (2, 3), generator=gen)
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        model.get_submodule(name).weight += 0.5 * b @ a
        want_lora = model(input_ids=ids).logits
    good = checkpoint_weight_source(tmp_path / "m")
    assert torch.equal(good(name), models.load_model(tmp_path / "m").get_submodule(name).weight)
    assert good("model.layers.0.mlp.nothing") is None

    def bad(_):  # right shape, wrong values: must not be used
        return torch.zeros(16, 1200)

    for source in (good, bad):
        base = models.load_model(tmp_path / "m")
        adapter = LoraAdapter(tmp_path / "a", "base", {name: (a, b, 0.5)}, {})
        with kernels.force("packed_gemm", "kernel"):
            stack = StackedLoRA(
                base, [adapter, None], ["a", "base"], weight_source=source, use_kernel=use_kernel
            )
        layer = stack.model.get_submodule(name)
        if use_kernel:
            width = GEMM.panel_width
            assert layer.weight_packed.shape == (-(-16 // width), 1200, width)
            assert torch.equal(
                layer.weight, models.load_model(tmp_path / "m").get_submodule(name).weight
            )
        else:
            assert layer.weight_chunks.shape == (3, 16, 400)
        with torch.inference_mode():
            out = stack(ids, mask, pos)  # (2, B, T, V)
        torch.testing.assert_close(out[1], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[0], want_lora, atol=1e-4, rtol=1e-4)


def test_read_lora_adapter_scaling_and_extras(lora):
    a0 = read_lora_adapter(lora["refs"][0])
    a2 = read_lora_adapter(lora["refs"][2])
    assert a0.base_ref == str((lora["root"] / "base").resolve())
    name = "model.layers.0.self_attn.q_proj"
    a, b, s = a0.modules[name]
    assert a.shape == (8, 32) and b.shape == (32, 8) and s == pytest.approx(16 / 8)
    assert a2.modules[name][2] == pytest.approx(12 / 6**0.5)  # rsLoRA: alpha / sqrt(r)
    assert "lm_head" in a0.modules and set(a0.extra) == {"lm_head"}  # PEFT saves the head too
    assert len(a0.modules) == 2 * 7 + 1 and "lm_head" not in a2.modules


# ------------------------------------------------------------------------------ fallback


def test_full_model_constituent_falls_back_with_reason(lora, caplog):
    root = lora["root"]
    full = testing.perturbed_copy(lora["base"], seed=5)
    full.save_pretrained(str(root / "full"))
    lora["tok"].save_pretrained(str(root / "full"))
    path = models.write_bundle(
        root / "bundle-mixed", base=root / "base", constituents=[lora["refs"][0], root / "full"]
    )
    with caplog.at_level(logging.INFO, logger="scpdr.lora"):
        lm = ProtectedLM.from_bundle(path, method="scp-delta-r")
    assert not lm.fast_path.on and "full model, not a LoRA adapter" in lm.fast_path.reason
    assert "LoRA fast path off" in caplog.text and "full model, not a LoRA adapter" in caplog.text
    general = ProtectedLM(
        [lora["merged"][0], models.load_model(root / "full")], lora["tok"], base_model=lora["base"]
    )
    enc = _encode(lora["tok"], "right")
    # the fallback is the general path: the same models and forwards, the same arithmetic
    torch.testing.assert_close(
        lm.score(enc["input_ids"], enc["attention_mask"]),
        general.score(enc["input_ids"], enc["attention_mask"]),
        atol=1e-6,
        rtol=0,
    )
    ga = lm.generate(PROMPTS, max_new_tokens=4, stop_at_eos=False)
    gb = general.generate(PROMPTS, max_new_tokens=4, stop_at_eos=False)
    assert [g.token_ids for g in ga] == [g.token_ids for g in gb]


def _off_reason(manifest, caplog, **kw):
    kw = {"method": "scp-delta-r", "base": "model", **kw}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scpdr.lora"):
        assert stacked_from_bundle("/", manifest, **kw) is None
    assert "LoRA fast path off" in caplog.text
    return caplog.text


def test_other_fallbacks_log_their_reason(lora, caplog, monkeypatch):
    root, refs = lora["root"], lora["refs"]
    ok = _manifest(root / "base", refs[:2])
    assert "method 'none' runs one model" in _off_reason(ok, caplog, method="none")
    monkeypatch.setenv("SCPDR_LORA_FAST", "0")
    assert "SCPDR_LORA_FAST=0" in _off_reason(ok, caplog)
    monkeypatch.delenv("SCPDR_LORA_FAST")
    # an adapter over a different base model
    other = testing.tiny_model(1)
    other.save_pretrained(str(root / "base-other"))
    save_random_lora(other, root / "adapter-other", base_ref="../base-other", seed=9)
    mixed = _manifest(root / "base", [refs[0], root / "adapter-other"])
    assert "different base models" in _off_reason(mixed, caplog)
    # the base of SCP-Δr-b is another full model than the adapters' base ...
    other_base = _manifest(root / "base-other", refs[:2])
    assert "base (" in _off_reason(other_base, caplog) and "full model" in caplog.text
    # ... which does not matter for methods without a base model
    stack = stacked_from_bundle("/", other_base, method="cp-delta", base="model")
    assert stack is not None and stack.num_groups == 2


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "IA3 adapter, not LoRA"),
        ({"bias": "all"}, "trains biases"),
        ({"alpha_pattern": {"q_proj": 3}}, "alpha_pattern"),
        ({"lora_bias": True}, "lora_bias"),
        ("magnitude", "not a LoRA A/B matrix"),
    ],
)
def test_unsupported_adapter_features_fall_back(lora, caplog, tmp_path, edit, reason):
    d = tmp_path / "adapter"
    shutil.copytree(lora["refs"][1], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str((lora["root"] / "base").resolve())
    if edit == "magnitude":  # a DoRA magnitude vector among the weights
        from safetensors.torch import load_file, save_file

        w = load_file(str(d / "adapter_model.safetensors"))
        w["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(32)
        save_file(w, str(d / "adapter_model.safetensors"))
    else:
        cfg.update(edit)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedAdapterError, match=reason):
        read_lora_adapter(d)
    assert reason in _off_reason(_manifest(lora["root"] / "base", [lora["refs"][0], d]), caplog)


# ------------------------------------------------------------------ the packed CPU kernel


needs_kernel = pytest.mark.skipif(
    not KERNEL, reason="no C compiler: the fast path uses torch's matmuls (tested above)"
)


def _packed_layer(gen, n_in, n_out, rank, groups_with_lora, bias):
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=gen))
    a = b = None
    if groups_with_lora:
        a = torch.randn(groups_with_lora, n_in, rank, generator=gen)
        b = torch.randn(groups_with_lora, rank, n_out, generator=gen)
    mode = GroupMode()
    return layer, a, b, mode


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_in=st.sampled_from([1, 7, 64, 200, 1536, 7000]),
    n_out=st.sampled_from([1, 5, 64, 65, 130, 192]),
    rank=st.sampled_from([1, 3, 64, 70]),
    groups=st.integers(1, 4),
    lora=st.integers(0, 4),
    rows=st.integers(1, 40),
    bias=st.booleans(),
)
def test_packed_kernel_equals_its_torch_reference(
    seed, n_in, n_out, rank, groups, lora, rows, bias
):
    """Property: the C kernel's stacked linear (base matmul of all rows, then the deltas of the
    first L groups) equals x·Wᵀ + bias + (x_g·A_gᵀ)·(s_g·B_g)ᵀ computed by torch from the
    unpacked weights, for shapes off the panel width (n and r not multiples of 64), row counts
    across the 6-row tiles and the L2 row chunks (7000 inputs: 6-row chunks), in stacked and
    single-group modes."""
    gen = torch.Generator().manual_seed(seed)
    lora = min(lora, groups)
    layer, a, b, mode = _packed_layer(gen, n_in, n_out, rank, lora, bias)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    assert lin.weight_packed is not None
    torch.testing.assert_close(lin.weight, layer.weight, atol=0, rtol=0)  # lossless layout
    x = torch.randn(groups * rows, n_in, generator=gen)
    want = layer(x)
    for g in range(lora):
        want[g * rows : (g + 1) * rows] += (x[g * rows : (g + 1) * rows] @ a[g]) @ b[g]
    tol = {"atol": 2e-5 * n_in**0.5 * (1 + rank**0.5), "rtol": 1e-4}
    with torch.inference_mode():
        mode.stacked = groups
        torch.testing.assert_close(lin(x), want, **tol)
        mode.stacked, mode.single = None, 0 if lora else None
        single = layer(x[:rows]) + ((x[:rows] @ a[0]) @ b[0] if lora else 0)
        torch.testing.assert_close(
            lin(x[:rows].view(1, rows, n_in)), single.view(1, rows, -1), **tol
        )


@needs_kernel
def test_packed_layer_keeps_autograd_through_the_torch_reference():
    """With a graph to build, the packed layer runs its torch reference: gradients reach x."""
    gen = torch.Generator().manual_seed(0)
    layer, a, b, mode = _packed_layer(gen, 10, 70, 3, 2, True)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    mode.stacked = 2
    x = torch.randn(4, 10, generator=gen, requires_grad=True)
    y = lin(x)
    assert y.grad_fn is not None
    y.sum().backward()
    want = layer.weight.sum(0) + torch.zeros(4, 10)
    want[:2] += (a[0] @ b[0]).sum(1)
    want[2:] += (a[1] @ b[1]).sum(1)
    torch.testing.assert_close(x.grad, want.detach(), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), y.detach(), atol=1e-4, rtol=1e-4)


def test_kernel_switch_keeps_torch_matmuls(monkeypatch):
    """SCPDR_GEMM_KERNEL=0 (or a float16 model, or no compiler) leaves the layers on torch's
    matmuls; the pack/unpack layout itself round-trips exactly."""
    monkeypatch.setenv("SCPDR_GEMM_KERNEL", "0")
    model = _tiny_llama(1, wide=False)
    adapter = testing.random_lora_adapter(model, "model.layers.0.self_attn.q_proj", rank=2)
    stack = StackedLoRA(model, [adapter, None], ["a", "base"])
    assert not any(m.weight_packed is not None for m in _wrapped(stack))
    w = torch.randn(130, 9)
    for width in (16, 24, 32, 64):
        packed = pack_panels(w, width)
        assert packed.shape == (-(-130 // width), 9, width)
        assert torch.equal(unpack_panels(packed, 130), w)
        assert not packed[-1, :, 130 % width :].any()  # columns past n are zeros


@needs_kernel
def test_tied_embeddings_are_read_from_the_packed_head():
    """On a tied model (SmolLM2) the input embeddings become lookups into the packed head (one
    vocab x hidden copy, not two) and give the original rows; the adapters handed over with
    release_adapters=True are emptied."""
    model = _tiny_llama(2, wide=False)
    emb = model.get_input_embeddings().weight.detach().clone()
    adapter = testing.random_lora_adapter(
        model, "model.layers.0.self_attn.v_proj", rank=3, scale=0.5
    )
    with kernels.force("packed_gemm", "kernel"):
        stack = StackedLoRA(model, [adapter, None], ["a", "base"], release_adapters=True)
    packed_emb = stack.model.get_input_embeddings()
    assert isinstance(packed_emb, PackedEmbedding)
    assert packed_emb.head is stack.model.get_output_embeddings()
    ids = torch.tensor([[0, 1, 63, 64, 65, 96], [5, 5, 0, 95, 96, 2]])
    assert torch.equal(packed_emb(ids), emb[ids])
    assert torch.equal(packed_emb.weight, emb)
    assert adapter.modules == {}  # released into the stack


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 24, 200])
def test_packed_kernel_gives_the_same_bits_on_any_thread_count(rows):
    """The panels split over torch's threads; each output is still summed by one thread in the
    same order, so 1 and 2 threads agree bit for bit (and with the torch reference)."""
    gen = torch.Generator().manual_seed(rows)
    layer, a, b, mode = _packed_layer(gen, 576, 1000, 64, 3, False)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    mode.stacked = 3
    x = torch.randn(3 * rows, 576, generator=gen)
    n = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append(lin(x))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0], outs[1])
    want = lin.reference_forward(x)
    torch.testing.assert_close(outs[0], want, atol=2e-3, rtol=1e-4)


@needs_kernel
def test_packed_layer_takes_other_dtypes_through_the_reference():
    """A bfloat16 input (autocast) never reaches the float32 kernel: the torch reference runs
    and the output keeps the input's dtype."""
    gen = torch.Generator().manual_seed(1)
    layer, a, b, mode = _packed_layer(gen, 32, 70, 4, 1, False)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    mode.single = 0
    x = torch.randn(5, 32, generator=gen)
    with torch.inference_mode():
        want = lin(x)
        got = lin(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.5, rtol=0.05)


@needs_kernel
def test_packed_layer_follows_the_group_mode_and_its_buffers():
    """A packed layer keeps its kernel call's fixed arguments per input shape and group mode:
    the same input shape in stacked and single mode (each group) gets each mode's deltas, and a
    buffer replaced in place of another (new addresses) is the one read."""
    gen = torch.Generator().manual_seed(5)
    layer, a, b, mode = _packed_layer(gen, 40, 70, 3, 2, True)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    x = torch.randn(4, 40, generator=gen)
    tol = {"atol": 1e-4, "rtol": 1e-4}
    with torch.inference_mode():
        base = layer(x)
        for _ in range(2):  # the second round reuses each mode's call
            mode.stacked, mode.single = 2, None
            want = base.clone()
            want[:2] += (x[:2] @ a[0]) @ b[0]
            want[2:] += (x[2:] @ a[1]) @ b[1]
            torch.testing.assert_close(lin(x), want, **tol)
            for g in (0, 1):
                mode.stacked, mode.single = None, g
                torch.testing.assert_close(lin(x), base + (x @ a[g]) @ b[g], **tol)
        lin.lora_a_packed = lin.lora_a_packed.flip(0).contiguous()  # the groups' A swapped
        lin.lora_b_packed = lin.lora_b_packed.flip(0).contiguous()
        torch.testing.assert_close(lin(x), base + (x @ a[0]) @ b[0], **tol)  # single = 1


@needs_kernel
def test_packed_layer_edge_cases():
    """Rank 0 (an empty delta) gives the base output; a row count that does not split into the
    stacked groups is refused; a packed layer can be deep-copied (no ctypes handle on it);
    the packed embeddings refuse ids outside the vocabulary like nn.Embedding."""
    import copy

    gen = torch.Generator().manual_seed(3)
    layer, a, b, mode = _packed_layer(gen, 8, 70, 0, 1, False)
    lin = StackedLoraLinear(layer, a, b, mode, gemm=GEMM)
    mode.stacked = 2
    x = torch.randn(4, 8, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), layer(x), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="do not split into 2 stacked groups"):
            lin(x[:3])
        twin = copy.deepcopy(lin)
        assert torch.equal(twin(x), lin(x))
    model = _tiny_llama(2, wide=False)
    adapter = testing.random_lora_adapter(model, "model.layers.0.self_attn.v_proj", rank=2)
    with kernels.force("packed_gemm", "kernel"):
        emb = StackedLoRA(model, [adapter, None], ["a", "base"]).model.get_input_embeddings()
    for bad in (-1, 97, 127):  # 97..127: zero columns of the last panel
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 97\)"):
            emb(torch.tensor([[3, bad]]))
