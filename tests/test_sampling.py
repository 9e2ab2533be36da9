"""scpdr.runtime.sampling: the one SamplingParams (validated at construction) and the batched
sampler, checked token for token against the former per-row sampler (the slow reference)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.runtime.sampling import SamplingParams, make_generator, resolve_sampling, sample


def _sample_row_reference(log_r, *, temperature, top_p, top_k, generator):
    """The per-row sampler ProtectedLM used before sampling was batched (kept as the reference):
    ``r^(1/temperature)`` restricted to top-k and the top-p nucleus, one multinomial draw."""
    logits = log_r.float() / temperature  # (V,)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_l, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_l, dim=-1)
        cum = probs.cumsum(-1)
        drop_sorted = (cum - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator).item())


row = st.tuples(
    st.sampled_from([0.0, 0.3, 1.0, 2.5]),  # temperature (0 = greedy)
    st.sampled_from([1.0, 0.9, 0.5, 1e-6]),  # top_p
    st.sampled_from([0, 1, 5, 40, 500]),  # top_k (>= V: off)
    st.integers(0, 2**31 - 1),  # seed
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(row, min_size=1, max_size=6),
    vocab=st.sampled_from([7, 64, 300]),
    scale=st.sampled_from([0.5, 3.0, 10.0]),
    data_seed=st.integers(0, 1000),
    steps=st.integers(1, 3),
)
def test_batched_sampler_equals_the_per_row_reference(rows, vocab, scale, data_seed, steps):
    g = torch.Generator().manual_seed(data_seed)
    params = [SamplingParams(8, t, p, k, seed=s) for t, p, k, s in rows]
    gens = [make_generator(p) for p in params]
    ref_gens = [make_generator(p) for p in params]
    for _ in range(steps):  # the generators advance identically step after step
        log_r = torch.log_softmax(torch.randn(len(rows), vocab, generator=g) * scale, -1)
        before = log_r.clone()
        got = sample(log_r, params, gens).tolist()
        assert torch.equal(log_r, before)  # never modified
        want = [
            int(log_r[j].argmax())
            if p.greedy
            else _sample_row_reference(
                log_r[j],
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                generator=ref_gens[j],
            )
            for j, p in enumerate(params)
        ]
        assert got == want


def test_top_k_and_top_p_restrict_the_support():
    log_r = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2), -1)
    seen = set()
    for s in range(200):
        ps = [
            SamplingParams(temperature=5.0, top_k=2, seed=s),
            SamplingParams(temperature=5.0, top_p=0.5, seed=s),
        ]
        toks = sample(log_r, ps, [make_generator(p) for p in ps]).tolist()
        assert toks[0] in (0, 1)
        seen.add(toks[1])
    q = torch.softmax(log_r[0] / 5.0, -1)  # the tempered distribution, sorted already
    assert float(q[0]) < 0.5 < float(q[:2].sum())  # its nucleus of mass 0.5: {0, 1}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an int"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an int >= 0"),
        ({"seed": "7"}, "seed must be an int or None"),
        ({"logprobs": -1}, "logprobs must be None or an int >= 0"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": 3}, "stop must be a str"),
        ({"echo": 1}, "echo must be a bool"),
        ({"stop_at_eos": None}, "stop_at_eos must be a bool"),
    ],
)
def test_sampling_params_are_validated_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalize_and_per_prompt():
    p = SamplingParams(4, temperature=1, top_p=1, stop="END")
    assert p.stop == ("END",) and isinstance(p.temperature, float) and not p.greedy
    assert p == SamplingParams(4, 1.0, 1.0, 0, ("END",))
    assert hash(p) == hash(SamplingParams(4, 1.0, 1.0, 0, ["END"]))  # frozen, hashable
    rows = SamplingParams.per_prompt(
        3, max_new_tokens=[1, 2, 3], stop=[None, "x", ["y", "z"]], seed=5, top_logprobs=2
    )
    assert [r.max_new_tokens for r in rows] == [1, 2, 3]
    assert [r.stop for r in rows] == [(), ("x",), ("y", "z")]
    assert {r.seed for r in rows} == {5} and {r.logprobs for r in rows} == {2}
    assert SamplingParams.per_prompt(1)[0].logprobs is None  # top_logprobs=0: no alternatives
    assert rows[0].to_dict()["stop"] == ()
    with pytest.raises(ValueError, match="seed has 2 entries but there are 3 prompts"):
        SamplingParams.per_prompt(3, seed=[1, 2])
    with pytest.raises(ValueError, match="stop has 2 per-prompt entries"):
        SamplingParams.per_prompt(3, stop=[None, "x"])
    with pytest.raises(ValueError, match="top_logprobs must be an int >= 0"):
        SamplingParams.per_prompt(3, top_logprobs=-1)


def test_generate_keywords_or_sampling_params_not_both():
    """``generate``'s sampling keywords and ``sampling=`` are two ways to say one thing."""
    shared = SamplingParams(3, temperature=0.5, seed=1)
    assert resolve_sampling(2, shared, {}) == [shared, shared]
    assert resolve_sampling(2, None, {"max_new_tokens": 3, "temperature": 0.5, "seed": 1}) == [
        shared,
        shared,
    ]
    with pytest.raises(ValueError, match="either as sampling= or as keyword arguments"):
        resolve_sampling(2, shared, {"max_new_tokens": 3})
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*max_tokens"):
        resolve_sampling(2, None, {"max_tokens": 3})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(ValueError, match="one SamplingParams or one per prompt"):
        resolve_sampling(2, [shared], {})


def test_unseeded_rows_follow_torch_manual_seed():
    p = SamplingParams(temperature=1.0)
    log_r = torch.log_softmax(torch.randn(1, 50), -1)
    torch.manual_seed(0)
    a = sample(log_r, [p], [make_generator(p)])
    torch.manual_seed(0)
    assert torch.equal(a, sample(log_r, [p], [make_generator(p)]))
    assert make_generator(SamplingParams()) is None  # greedy: no generator
