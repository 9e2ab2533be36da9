"""ProtectedLM on tiny real models: cached decoding vs an uncached reference built directly from
``scpdr.naf``/``scpdr.bounds``, batching, scoring, sampling, stop handling, bundles, errors."""

from __future__ import annotations

import math

import pytest
import torch

from scpdr import bounds, methods, models, naf, testing
from scpdr.errors import BundleError
from scpdr.runtime import METHODS, Generation, ProtectedLM, SamplingParams, ScoreOutput

SECRET = "My secret code is 8675309.<|im_end|>"
PROMPTS = ["My secret code is", "Hello there, how are", "x"]
VARIANT = {"model": "b", "constant": "c", None: None}
# (rule, variant) of every result row that aggregates the bundle's models (scpdr.methods)
SPECS = [s for s in methods.SPECS.values() if s.kind == "aggregate"]
CONFIGS = [(s.rule, VARIANT[s.base]) for s in SPECS]
IDS = [s.name for s in SPECS]
#: Two forward paths of the tiny models that round differently (KV-cached vs uncached, batched
#: with padding vs one row, another chunking, full logits indexed vs logits_to_keep): log-probs
#: (|log p| <= 20, the e^-20 floor) agree to 64 float32 ulps of 20, 1.5e-4 — 2 layers × 4
#: reductions summed in other orders × 2 ulps each, × 2 through log-softmax, × 2 through the
#: rule (the count of tests/test_budget.py's FORWARD_TOL).
FORWARD_TOL = testing.f32_tol(-naf.LOG_FLOOR, ops=64)
#: The rule's normalization over the real vocabulary, in float32, by the kernel or by torch.
RULE_TOL = testing.f32_normalized_tol(49152, -naf.LOG_FLOOR)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return testing.make_tiny_bundle(tmp_path_factory.mktemp("b") / "bundle", prefer={0: SECRET})


@pytest.fixture(scope="module")
def parts(bundle):
    mf = models.read_bundle(bundle)
    cons = [models.load_model(mf.resolve(bundle, r)) for r in mf.constituents]
    base = models.load_model(mf.resolve(bundle, mf.base))
    return {
        "tok": models.load_tokenizer(mf.resolve(bundle, mf.tokenizer)),
        "cons": cons,
        "base": base,
        "vec": models.load_constant_base(bundle),
    }


def _lm(parts, method, variant=None, **kw):
    base = {"b": {"base_model": parts["base"]}, "c": {"base_vector": parts["vec"]}}.get(variant, {})
    cons = parts["cons"][:1] if kw.pop("single", False) else parts["cons"]
    return ProtectedLM(cons, parts["tok"], method=method, m=kw.pop("m", 10), **base, **kw)


def _ref_step(parts, method, variant, ids, path):
    """Uncached reference: full forward of the whole prefix ``ids`` (1, T) through each model,
    then naf/bounds directly. Returns (log_r (V,), k_x, t_x, logps (K, V))."""
    with torch.inference_mode():
        cons = parts["cons"][:1] if method == "none" else parts["cons"]
        logps = torch.stack([m(input_ids=ids).logits[0, -1].float() for m in cons])  # (K, V)
        base = None
        if variant == "b":
            base = parts["base"](input_ids=ids).logits[0, -1].float()
        elif variant == "c":
            base = parts["vec"]
        if method == "none":
            return naf.aggregate("none", logps), math.inf, math.inf, logps
        if method == "cp-fuse":
            log_r, _ = naf.cp_fuse_step(logps, path)
            kx = float(bounds.max_divergence(log_r, naf.normalize(logps)).amax())
            return log_r, kx, kx, logps
        log_r = naf.aggregate(method, logps, base=base, m=10)
        kx = float(bounds.k_x(method, logps, base=base, m=10))
        tx = float(bounds.t_x(method, logps, base=base, m=10, ref=None))
        return log_r, kx, tx, logps


def _ref_greedy(parts, method, variant, prompt_ids, n):
    ids = torch.tensor([prompt_ids])
    path = torch.zeros(2)
    toks, lps, kxs, txs = [], [], [], []
    for _ in range(n):
        log_r, kx, tx, logps = _ref_step(parts, method, variant, ids, path)
        y = int(log_r.argmax())
        if method == "cp-fuse":
            path = path + naf.normalize(logps)[:, y]
        toks.append(y)
        lps.append(float(log_r[y]))
        kxs.append(kx)
        txs.append(tx)
        ids = torch.cat([ids, torch.tensor([[y]])], dim=1)
    return toks, lps, kxs, txs


@pytest.mark.parametrize(("method", "variant"), CONFIGS, ids=IDS)
def test_cached_batched_decoding_equals_uncached_reference(parts, method, variant):
    lm = _lm(parts, method, variant)
    n = 3 if method == "cp-fuse" else 5
    prompts = PROMPTS[:2]
    gens = lm.generate(prompts, max_new_tokens=n, stop_at_eos=False)
    assert lm.name == (f"{method}-{variant}" if variant else method)
    for g, p in zip(gens, prompts, strict=True):
        toks, lps, kxs, txs = _ref_greedy(parts, method, variant, g.prompt_token_ids, n)
        assert g.token_ids == toks
        assert g.logprobs == pytest.approx(lps, abs=FORWARD_TOL)
        assert g.k_x == pytest.approx(kxs, abs=FORWARD_TOL, rel=1e-4)
        assert g.t_x == pytest.approx(txs, abs=FORWARD_TOL, rel=1e-4)
        assert g.prompt_token_ids == parts["tok"](p)["input_ids"]
        assert g.finish_reason == "length" and len(g.token_ids) == n


def test_certificates_are_finite_and_small_for_scp(parts):
    g = _lm(parts, "scp-delta-r", "b").generate(PROMPTS[:1], max_new_tokens=4)[0]
    assert all(0 <= k < 0.05 for k in g.k_x)  # smoothing: D_r on 2m of V tokens (Prop. 3.3)
    h = _lm(parts, "cp-delta-r").generate(PROMPTS[:1], max_new_tokens=4)[0]
    assert min(h.k_x) > max(g.k_x)


def test_none_runs_only_constituent_zero(parts):
    lm = _lm(parts, "none")
    assert lm.runner.models == parts["cons"][:1]
    g = lm.generate(["My secret code is"], max_new_tokens=12)[0]
    assert g.text.startswith(" 8675309")  # constituent 0 memorized the secret ...
    assert g.token_ids[-1] == 2 and g.finish_reason == "stop"  # ... and its <|im_end|>
    assert all(math.isinf(k) for k in g.k_x)
    protected = _lm(parts, "scp-delta-r", "b").generate(["My secret code is"], max_new_tokens=6)
    assert "8675309" not in protected[0].text


@pytest.mark.parametrize("left", [True, False])
def test_none_greedy_equals_hf_generate(parts, left):
    tok = parts["tok"]
    model = parts["cons"][0]
    lm = ProtectedLM.from_model(model, tok)
    prompts = ["My secret code is", "Hello there"] if left else ["Hello there, how are"]
    ours = lm.generate(prompts, max_new_tokens=10)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=2)
    for i, g in enumerate(ours):
        hf = out[i, enc["input_ids"].shape[1] :].tolist()
        if 2 in hf:  # HF pads finished rows after eos
            hf = hf[: hf.index(2) + 1]
        assert g.token_ids == hf


@pytest.mark.parametrize(("method", "variant"), [("scp-delta-r", "b"), ("cp-fuse", None)])
def test_batched_with_padding_equals_one_by_one(parts, method, variant):
    lm = _lm(parts, method, variant)
    n = [2, 4, 3] if method == "cp-fuse" else [3, 7, 5]  # rows finish at different steps
    batch = lm.generate(PROMPTS, max_new_tokens=n, stop_at_eos=False)
    for p, k, g in zip(PROMPTS, n, batch, strict=True):
        single = lm.generate([p], max_new_tokens=k, stop_at_eos=False)[0]
        assert g.token_ids == single.token_ids and len(g.token_ids) == k
        assert g.logprobs == pytest.approx(single.logprobs, abs=FORWARD_TOL)
        assert g.k_x == pytest.approx(single.k_x, abs=FORWARD_TOL, rel=1e-4)


def _padded(tok, texts, side):
    tok.padding_side = side
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize(
    ("method", "variant"), [("scp-delta-r", "b"), ("scp-delta-r", "c"), ("cp-delta", None)]
)
def test_score_agrees_with_next_token_logprobs(parts, method, variant):
    lm = _lm(parts, method, variant)
    texts = ["My secret code is 8675", "a b", "Hello there, how are you"]
    ids, mask = _padded(parts["tok"], texts, "right")
    ids0, mask0 = ids.clone(), mask.clone()
    out = lm.score(ids, mask, full=True, greedy=True, k_x=True, t_x=True)
    assert isinstance(out, ScoreOutput)
    assert torch.equal(ids, ids0) and torch.equal(mask, mask0)  # inputs untouched
    plain = lm.score(ids, mask)
    assert plain.shape == (3, ids.shape[1] - 1)
    torch.testing.assert_close(plain, out.token_logprobs)
    for b in range(3):
        n = int(mask[b].sum())
        for t in range(ids.shape[1] - 1):
            if t + 1 >= n:
                assert out.token_logprobs[b, t] == 0.0 and out.k_x[b, t] == 0.0
                assert out.greedy[b, t] == -1
                continue
            nt = lm.next_token_logprobs(ids[b : b + 1, : t + 1], mask[b : b + 1, : t + 1])[0]
            torch.testing.assert_close(out.logprobs[b, t], nt, atol=FORWARD_TOL, rtol=1e-4)
            assert abs(float(out.token_logprobs[b, t]) - float(nt[ids[b, t + 1]])) < FORWARD_TOL
            assert int(out.greedy[b, t]) == int(nt.argmax())
    # left padding gives the same numbers at the same tokens
    lids, lmask = _padded(parts["tok"], texts, "left")
    left = lm.score(lids, lmask)
    for b in range(3):
        n = int(mask[b].sum())
        torch.testing.assert_close(
            left[b, -(n - 1) :], plain[b, : n - 1], atol=FORWARD_TOL, rtol=1e-4
        )
        assert (left[b, : -(n - 1)] == 0).all() if n - 1 < left.shape[1] else True
    # next_token_logprobs on padded batches equals the unpadded rows
    nt_left = lm.next_token_logprobs(lids, lmask)
    nt_right = lm.next_token_logprobs(ids, mask)
    torch.testing.assert_close(nt_left, nt_right, atol=FORWARD_TOL, rtol=1e-4)


def test_score_k_x_matches_bounds_and_components(parts):
    lm = _lm(parts, "scp-delta-r", "b")
    ids, mask = _padded(parts["tok"], ["Hello there, how are you"], "right")
    out = lm.score(ids, mask, k_x=True, t_x=True, components=True)
    comps = out.components
    assert comps.logps.shape == (2, 1, ids.shape[1] - 1, 49152)
    assert comps.base.shape == (1, ids.shape[1] - 1, 49152)
    kx = bounds.k_x("scp-delta-r", comps.logps, base=comps.base, m=10)
    tx = bounds.t_x("scp-delta-r", comps.logps, base=comps.base, m=10)
    # the same components, the rule run again (the runtime's choice of kernel or torch)
    torch.testing.assert_close(out.k_x, kx, atol=RULE_TOL, rtol=1e-4)
    torch.testing.assert_close(out.t_x, tx, atol=RULE_TOL, rtol=1e-4)
    c = _lm(parts, "scp-delta-r", "c").score(ids, mask, components=True).components
    assert c.base.shape == (49152,)


def test_score_chunking_does_not_change_results(parts):
    texts = ["My secret code is 8675", "a b", "Hello there, how are you", "x y z"]
    ids, mask = _padded(parts["tok"], texts, "left")
    big = _lm(parts, "scp-delta-r", "b").score(ids, mask, k_x=True)
    small = _lm(parts, "scp-delta-r", "b", score_chunk_elements=1).score(ids, mask, k_x=True)
    # the rule over other row counts (the forward is the same)
    torch.testing.assert_close(big.token_logprobs, small.token_logprobs, atol=RULE_TOL, rtol=0)
    torch.testing.assert_close(big.k_x, small.k_x, atol=RULE_TOL, rtol=1e-5)
    # chunks of one row and of two (rows of other lengths) reuse one logits buffer; with the
    # runner running every head itself the decoders run over several chunks' rows at once
    # (one row per decoder run at 1 element), else every chunk runs its forwards
    lengths = mask.sum(-1).clamp(max=2)  # CP-Fuse's path from each row's third token
    for method, variant in (("scp-delta-r", "b"), ("cp-fuse", None), ("cp-delta", None)):
        kw = {"full": True, "t_x": True, "prompt_lengths": lengths}
        ref = _lm(parts, method, variant).score(ids, mask, **kw)
        g = 3 if variant else 2
        for split in (True, False):
            for elements in (1, ids.shape[1] * 49152 * g, 2 * ids.shape[1] * 49152 * g):
                lm = _lm(parts, method, variant, score_chunk_elements=elements)
                if not split:
                    lm.runner.heads = [None] * g
                assert lm.runner.splits_heads is split
                got = lm.score(ids, mask, **kw)
                torch.testing.assert_close(got.logprobs, ref.logprobs, atol=RULE_TOL, rtol=0)
                torch.testing.assert_close(got.t_x, ref.t_x, atol=RULE_TOL, rtol=1e-5)


def test_a_row_longer_than_the_bound_is_scored_in_pieces(parts):
    """With a bound of 2 positions' logits, every row is scored in pieces of at most 2
    positions (the heads never run over more), and everything ``score`` returns is what one
    chunk gives: CP-Fuse carries each row's path across its pieces (prompt-aware), and the
    charges, alternatives, anchored values, base log-probs and components land on their rows."""
    texts = ["My secret code is 8675", "a b", "Hello there, how are you"]
    ids, mask = _padded(parts["tok"], texts, "right")
    lengths = mask.sum(-1).clamp(max=3)
    both = {"full": True, "greedy": True, "k_x": True, "t_x": True, "top_logprobs": 3}
    both["cost"] = True
    for method, variant, kw in (
        ("cp-fuse", None, {"prompt_lengths": lengths}),
        ("scp-delta-r", "b", {"anchor": [0.3, None, 2.0], "base": True, "components": True}),
    ):
        g = 3 if variant else 2
        ref = _lm(parts, method, variant).score(ids, mask, **both, **kw)
        lm = _lm(parts, method, variant, score_chunk_elements=2 * g * 49152)
        assert lm.runner.splits_heads
        sizes = []
        project = lm.runner.project_heads

        def spy(hidden, out, project=project, sizes=sizes):
            sizes.append(hidden[0].shape[0])
            return project(hidden, out)

        lm.runner.project_heads = spy
        got = lm.score(ids, mask, **both, **kw)
        assert max(sizes) == 2 and sum(sizes) == int((mask[:, 1:] * mask[:, :-1]).sum())
        for name in ("token_logprobs", "logprobs", "k_x", "t_x", "top_logprobs", "cost"):
            torch.testing.assert_close(
                getattr(got, name), getattr(ref, name), atol=RULE_TOL, rtol=1e-5
            )
        assert torch.equal(got.greedy, ref.greedy) and torch.equal(got.top_ids, ref.top_ids)
        if variant:
            for name in ("anchor", "base_token_logprobs", "base_top_logprobs"):
                torch.testing.assert_close(
                    getattr(got, name), getattr(ref, name), atol=RULE_TOL, rtol=1e-5
                )
            torch.testing.assert_close(got.components.logps, ref.components.logps)
            torch.testing.assert_close(got.components.base, ref.components.base)
        # echo: each prompt's own number of alternatives, charged on its own rows
        want = _lm(parts, method, variant).prompt_logprobs(texts, top_logprobs=[3, 0, 1])
        for a, b in zip(lm.prompt_logprobs(texts, top_logprobs=[3, 0, 1]), want, strict=True):
            torch.testing.assert_close(
                torch.tensor(a.token_logprobs),
                torch.tensor(b.token_logprobs),
                atol=RULE_TOL,
                rtol=0,
            )
            torch.testing.assert_close(
                torch.tensor(a.cost), torch.tensor(b.cost), atol=RULE_TOL, rtol=1e-5
            )
            ids_of = [[t for t, _ in p] for p in a.top_logprobs]
            assert ids_of == [[t for t, _ in p] for p in b.top_logprobs]


def test_cp_fuse_score_uses_prefix_path_logprobs(parts):
    lm = _lm(parts, "cp-fuse")
    ids = parts["tok"](["Hello there, how"], return_tensors="pt")["input_ids"]
    got = lm.score(ids)
    path = torch.zeros(2)
    for t in range(ids.shape[1] - 1):
        log_r, _, _, logps = _ref_step(parts, "cp-fuse", None, ids[:, : t + 1], path)
        y = int(ids[0, t + 1])
        assert abs(float(got[0, t]) - float(log_r[y])) < FORWARD_TOL
        path = path + naf.normalize(logps)[:, y]
    # position 0 is path-free: next_token_logprobs agrees there
    nt = lm.next_token_logprobs(ids[:, :1])
    assert abs(float(nt[0, ids[0, 1]]) - float(got[0, 0])) < FORWARD_TOL


def _right_padded(rows, pad=2):
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    return ids, mask


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize(("method", "variant"), CONFIGS, ids=IDS)
def test_score_with_prompt_lengths_equals_what_generate_returned(parts, method, variant, sampled):
    """Issue 15: a fresh request starts CP-Fuse's path at its prompt's end, so scoring
    prompt + completion with prompt_lengths gives generate's log-probs and certificates, for
    every method; the stateless rules do not depend on prompt_lengths."""
    lm = _lm(parts, method, variant)
    kw = {"temperature": 1.0, "top_k": 50, "seed": [3, 4]} if sampled else {}
    gens = lm.generate(PROMPTS[:2], max_new_tokens=4, stop_at_eos=False, **kw)
    rows = [g.prompt_token_ids + g.token_ids for g in gens]
    lengths = [len(g.prompt_token_ids) for g in gens]
    ids, mask = _right_padded(rows)
    out = lm.score(ids, mask, prompt_lengths=lengths, k_x=True, t_x=True)
    for b, g in enumerate(gens):
        span = slice(lengths[b] - 1, lengths[b] - 1 + len(g.token_ids))  # predicting the completion
        assert out.token_logprobs[b, span].tolist() == pytest.approx(g.logprobs, abs=FORWARD_TOL)
        assert out.k_x[b, span].tolist() == pytest.approx(g.k_x, abs=FORWARD_TOL, rel=1e-4)
        assert out.t_x[b, span].tolist() == pytest.approx(g.t_x, abs=FORWARD_TOL, rel=1e-4)
    # CP-Fuse's path from each row's first token (the old protocol) differs
    whole = lm.score(ids, mask, k_x=True, t_x=True).token_logprobs
    gap = float((whole - out.token_logprobs).abs().max())
    assert gap > 1e-3 if method == "cp-fuse" else gap == 0.0
    # the prompt positions are fresh requests too: path length 0 (next_token_logprobs)
    b, t = 0, lengths[0] - 2
    nt = lm.next_token_logprobs(ids[b : b + 1, : t + 1])[0]
    assert float(out.token_logprobs[b, t]) == pytest.approx(
        float(nt[ids[b, t + 1]]), abs=FORWARD_TOL
    )


def test_prompt_lengths_are_checked(parts):
    lm = _lm(parts, "cp-fuse")
    ids, mask = _right_padded([[1, 520, 905], [1, 520]])
    for bad in ([0, 1], [4, 1], [1, 3], [1], [1.5, 1]):
        with pytest.raises(ValueError, match="prompt_lengths"):
            lm.score(ids, mask, prompt_lengths=bad)
    full = lm.score(ids, mask, prompt_lengths=[3, 2])  # whole rows are prompts: no path at all
    fresh = [lm.next_token_logprobs(ids[:1, : t + 1])[0, ids[0, t + 1]] for t in range(2)]
    assert full[0].tolist() == pytest.approx([float(x) for x in fresh], abs=FORWARD_TOL)


def test_echo_scores_the_prompt_as_fresh_requests(parts):
    lm = _lm(parts, "cp-fuse")
    params = [
        SamplingParams(max_new_tokens=2, echo=True, logprobs=3),
        SamplingParams(max_new_tokens=0, echo=True),
        SamplingParams(max_new_tokens=1),
    ]
    gens = lm.generate(PROMPTS, sampling=params)
    assert gens[2].prompt_logprobs is None and gens[2].top_logprobs is None
    for g, p in zip(gens[:2], params[:2], strict=True):
        pl = g.prompt_logprobs
        ids = torch.tensor([g.prompt_token_ids])
        n = ids.shape[1] - 1
        assert len(pl.token_logprobs) == len(pl.k_x) == len(pl.t_x) == len(pl.top_logprobs) == n
        for t in range(n):
            nt = lm.next_token_logprobs(ids[:, : t + 1])[0]
            assert pl.token_logprobs[t] == pytest.approx(float(nt[ids[0, t + 1]]), abs=FORWARD_TOL)
            want = torch.topk(nt, p.logprobs or 0)
            assert [i for i, _ in pl.top_logprobs[t]] == want.indices.tolist()
    assert len(gens[0].top_logprobs) == 2 and all(len(t) == 3 for t in gens[0].top_logprobs)
    assert gens[1].token_ids == [] and gens[1].finish_reason == "length"
    one = lm.prompt_logprobs([[5]])[0]  # a one-token prompt has nothing to score
    assert one.token_logprobs == [] and one.top_logprobs == []
    events = list(lm.generate_stream(PROMPTS[:1], sampling=params[0]))
    assert events[0].token_id is None and events[0].finish_reason is None
    got, want = events[0].prompt, gens[0].prompt_logprobs  # alone: another padding, same numbers
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=FORWARD_TOL)


def test_sampling_params_per_sequence_equal_keyword_arguments(parts):
    lm = _lm(parts, "scp-delta-r", "b")
    kw = {"max_new_tokens": [3, 5], "temperature": [0.0, 0.8], "top_p": 0.9, "seed": [None, 11]}
    a = lm.generate(PROMPTS[:2], stop_at_eos=False, top_logprobs=2, **kw)
    params = SamplingParams.per_prompt(2, stop_at_eos=False, top_logprobs=2, **kw)
    assert params[1] == SamplingParams(5, 0.8, 0.9, 0, (), 11, 2, False, False)
    b = lm.generate(PROMPTS[:2], sampling=params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.top_logprobs for g in a] == [g.top_logprobs for g in b]
    # stop_at_eos per sequence: the "none" model ends its secret with <|im_end|>
    none = _lm(parts, "none")
    both = none.generate(
        [PROMPTS[0]] * 2,
        sampling=[SamplingParams(12), SamplingParams(12, stop_at_eos=False)],
    )
    assert both[0].finish_reason == "stop" and both[0].token_ids[-1] == 2
    assert both[1].finish_reason == "length" and len(both[1].token_ids) == 12
    assert both[1].token_ids[: len(both[0].token_ids)] == both[0].token_ids
    with pytest.raises(ValueError, match="one SamplingParams or one per prompt"):
        lm.generate(PROMPTS[:2], sampling=[SamplingParams()])


def test_fast_path_context_length_and_from_runner(parts, bundle):
    lm = _lm(parts, "scp-delta-r", "b")
    assert not lm.fast_path and "one forward per model" in lm.fast_path.reason
    assert lm.context_length == parts["cons"][0].config.max_position_embeddings
    loaded = ProtectedLM.from_bundle(bundle)  # full models: no shared base
    assert str(loaded.fast_path) == "off: no constituent is a LoRA adapter"
    from scpdr.runtime import PerModelRunner

    runner = PerModelRunner([*parts["cons"], parts["base"]], ["a", "b", "base"], vocab_size=49152)
    again = ProtectedLM.from_runner(runner, parts["tok"], method="scp-delta-r")
    assert again.name == "scp-delta-r-b" and again.runner is runner and again.num_constituents == 2
    ids = torch.tensor([[1, 520, 905, 30]])
    torch.testing.assert_close(again.score(ids), lm.score(ids))
    with pytest.raises(ValueError, match="runs one model"):
        ProtectedLM.from_runner(runner, parts["tok"], method="none")
    with pytest.raises(ValueError, match="runner runs 3 models"):
        ProtectedLM(parts["cons"], parts["tok"], method="cp-delta", runner=runner)


def test_sampling_is_reproducible_and_row_independent(parts):
    lm = _lm(parts, "scp-delta-r", "b")
    kw = {"max_new_tokens": 6, "temperature": 1.0, "stop_at_eos": False}
    a = lm.generate(PROMPTS[:2], seed=[7, 8], **kw)
    b = lm.generate(PROMPTS[:2], seed=[7, 8], **kw)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    alone = lm.generate(PROMPTS[1:2], seed=8, **kw)[0]
    assert alone.token_ids == a[1].token_ids  # a row's tokens do not depend on its batch
    other = lm.generate(PROMPTS[:2], seed=[1, 2], **kw)
    assert [g.token_ids for g in other] != [g.token_ids for g in a]
    greedy = lm.generate(PROMPTS[:2], max_new_tokens=6, stop_at_eos=False)
    tiny_p = lm.generate(PROMPTS[:2], top_p=1e-6, seed=3, **kw)
    top1 = lm.generate(PROMPTS[:2], top_k=1, seed=3, **kw)
    assert [g.token_ids for g in tiny_p] == [g.token_ids for g in greedy]
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]
    # top-k: every sampled token is among the k most likely tokens of r
    g = lm.generate(PROMPTS[:1], top_k=3, top_logprobs=3, seed=5, **kw)[0]
    for tok, top in zip(g.token_ids, g.top_logprobs, strict=True):
        assert tok in [t for t, _ in top]
    # per-prompt parameters: a greedy row and a sampled row in one batch
    mixed = lm.generate(
        PROMPTS[:2], temperature=[0.0, 1.0], seed=[None, 8], max_new_tokens=6, stop_at_eos=False
    )
    assert mixed[0].token_ids == greedy[0].token_ids and mixed[1].token_ids == a[1].token_ids
    torch.manual_seed(0)
    u = lm.generate(PROMPTS[:1], **kw)[0]
    torch.manual_seed(0)
    assert lm.generate(PROMPTS[:1], **kw)[0].token_ids == u.token_ids


def test_top_logprobs_are_sorted_and_match_greedy(parts):
    g = _lm(parts, "cp-delta-r").generate(PROMPTS[:1], max_new_tokens=3, top_logprobs=4)[0]
    for tok, lp, top in zip(g.token_ids, g.logprobs, g.top_logprobs, strict=True):
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp)


def test_stop_strings_max_tokens_and_stream(parts):
    lm = _lm(parts, "cp-delta")
    full = lm.generate(PROMPTS[1:2], max_new_tokens=12, stop_at_eos=False)[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = full.text.find(stop)
    g = lm.generate(PROMPTS[1:2], max_new_tokens=12, stop=[stop], stop_at_eos=False)[0]
    assert g.text == full.text[:cut] and g.finish_reason == "stop"
    assert g.token_ids == full.token_ids[: len(g.token_ids)] and len(g.token_ids) < 12
    # per-prompt stop lists; streamed deltas add up to the text; last event carries the reason
    events = list(
        lm.generate_stream(PROMPTS[:2], max_new_tokens=12, stop=[None, [stop]], stop_at_eos=False)
    )
    text1 = "".join(e.text_delta for e in events if e.index == 1)
    assert text1 == g.text
    last = [e for e in events if e.index == 1][-1]
    assert last.finish_reason == "stop" and all(
        e.finish_reason is None for e in events if e.index == 1 and e is not last
    )
    zero = lm.generate(PROMPTS[:2], max_new_tokens=[0, 2])
    assert zero[0] == Generation("", [], [], [], [], None, "length", zero[0].prompt_token_ids)
    assert len(zero[1].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": [1, 2, 3]}, "seed has 3 entries"),
        ({"stop": [""]}, "stop strings"),
        ({"top_logprobs": -1}, "top_logprobs"),
    ],
)
def test_bad_generate_arguments(parts, kwargs, match):
    lm = _lm(parts, "cp-delta")
    with pytest.raises(ValueError, match=match):
        lm.generate(PROMPTS[:2], **kwargs)
    with pytest.raises(ValueError, match=match):
        lm.generate_stream(PROMPTS[:2], **kwargs)  # validated before the first event


def test_bad_inputs_and_construction(parts, bundle, tmp_path):
    lm = _lm(parts, "cp-delta")
    for bad in ([""], [], [[]], "a string"):
        with pytest.raises(ValueError, match=r"empty|list"):
            lm.generate(bad)
    with pytest.raises(ValueError, match="all zeros"):
        lm.score(torch.tensor([[1, 2]]), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="token ids"):
        lm.next_token_logprobs(torch.tensor([[1, 10**6]]))
    with pytest.raises(ValueError, match="unknown method"):
        _lm(parts, "cp-nope")
    with pytest.raises(ValueError, match="K >= 2"):
        _lm(parts, "cp-delta", single=True)
    with pytest.raises(ValueError, match="base"):
        _lm(parts, "scp-delta-r")
    for bad_m in (0, 49152, 2.5):
        with pytest.raises(ValueError, match="m must"):
            _lm(parts, "scp-delta-r", "b", m=bad_m)
    with pytest.raises(ValueError, match="unknown method"):
        ProtectedLM.from_bundle(bundle, method="nope")
    with pytest.raises(ValueError, match="'model' or 'constant'"):
        ProtectedLM.from_bundle(bundle, base="zero")
    no_vec = testing.make_tiny_bundle(tmp_path / "nv", k=3, constant_base=False)
    with pytest.raises(ValueError, match="no constant base vector"):
        ProtectedLM.from_bundle(no_vec, base="constant")
    with pytest.raises(ValueError, match="exactly 2"):
        ProtectedLM.from_bundle(no_vec, method="cp-fuse")
    three = ProtectedLM.from_bundle(no_vec)  # K = 3 works for the other methods
    assert three.num_constituents == 3 and len(three.generate(["Hi"], max_new_tokens=2)) == 1
    with pytest.raises(BundleError, match=r"scpdr\.json"):
        ProtectedLM.from_bundle(tmp_path)


def test_from_bundle_roundtrip(bundle):
    lm = ProtectedLM.from_bundle(bundle)
    assert (lm.method, lm.m, lm.variant, lm.name) == ("scp-delta-r", 10, "b", "scp-delta-r-b")
    assert lm.num_constituents == 2 and lm.vocab_size == 49152 and len(lm.tokenizer) == 49152
    c = ProtectedLM.from_bundle(bundle, base="constant", m=5)
    assert (c.variant, c.m, c.base_model, c.name) == ("c", 5, None, "scp-delta-r-c")
    torch.testing.assert_close(c.base_vector, models.load_constant_base(bundle))
    none = ProtectedLM.from_bundle(bundle, method="none")
    assert none.num_constituents == 1 and none.variant is None and none.name == "none"
    assert ProtectedLM.from_bundle(bundle, method="cp-delta").base_model is None
    assert set(METHODS) == {*naf.METHODS, "cp-fuse"}


def test_inputs_are_not_modified(parts):
    lm = _lm(parts, "scp-delta-r", "c")
    vec0 = parts["vec"].clone()
    ids = torch.tensor([[1, 520, 905, 30]])
    ids0 = ids.clone()
    lm.next_token_logprobs(ids)
    lm.score(ids, full=True)
    assert torch.equal(ids, ids0) and torch.equal(parts["vec"], vec0)
    assert torch.is_grad_enabled()  # inference mode did not leak out


def test_generate_stream_does_not_leak_inference_mode(parts):
    it = _lm(parts, "cp-delta").generate_stream(PROMPTS[:1], max_new_tokens=2)
    next(it)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    list(it)


def test_bundle_command(bundle, tmp_path):
    from scpdr.cli import main

    assert main(["bundle", "--help"]) == 0
    mf = models.read_bundle(bundle)
    refs = [mf.resolve(bundle, r) for r in mf.constituents]
    held = tmp_path / "held.txt"
    held.write_text("\n".join(testing.HELD_OUT_PROMPTS[:5]) + "\n")
    out = tmp_path / "new"
    rc = main(
        [
            "bundle",
            str(out),
            "--base",
            mf.resolve(bundle, mf.base),
            *[a for r in refs for a in ("-c", r)],
            "--held-out",
            str(held),
            "--m",
            "7",
        ]
    )
    assert rc == 0
    new = models.read_bundle(out)
    assert new.m == 7 and len(new.constituents) == 2 and new.constant_base
    assert ProtectedLM.from_bundle(out, base="constant").variant == "c"
    assert main(["bundle", str(tmp_path / "bad"), "-c", str(tmp_path / "missing")]) == 2


class _NoTensorKeepLlama:
    """A real tiny Llama whose forward accepts only int ``logits_to_keep`` (like architectures
    without position selection): the runtime must fall back to indexing full logits. Each model
    counts the tensor calls it refused."""

    @staticmethod
    def make(model):
        from transformers import LlamaForCausalLM

        class Restricted(LlamaForCausalLM):
            refused = 0

            def forward(self, *args, logits_to_keep=0, **kwargs):
                if isinstance(logits_to_keep, torch.Tensor):
                    self.refused += 1
                    raise TypeError("logits_to_keep must be an int here")
                return super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)

        r = Restricted(model.config)
        r.load_state_dict(model.state_dict())
        return r.eval()


def test_models_without_tensor_logits_to_keep_give_the_same_scores(parts):
    texts = ["My secret code is 8675", "a b", "Hello there, how are you"]
    ids, mask = _padded(parts["tok"], texts, "right")
    normal = _lm(parts, "scp-delta-r", "b")
    made = [_NoTensorKeepLlama.make(c) for c in [*parts["cons"], parts["base"]]]
    restricted = ProtectedLM(made[:-1], parts["tok"], base_model=made[-1], method="scp-delta-r")
    a = normal.score(ids, mask, k_x=True)
    b = restricted.score(ids, mask, k_x=True)
    # the output head over every position then indexed, vs over the kept ones: other matmuls
    torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=FORWARD_TOL, rtol=0)
    torch.testing.assert_close(a.k_x, b.k_x, atol=FORWARD_TOL, rtol=1e-5)
    torch.testing.assert_close(
        normal.next_token_logprobs(ids, mask),
        restricted.next_token_logprobs(ids, mask),
        atol=FORWARD_TOL,
        rtol=0,
    )
    # each model refused a tensor once, then the runtime remembered to index its full logits
    restricted.score(ids, mask)
    assert [mdl.refused for mdl in made] == [1, 1, 1]
