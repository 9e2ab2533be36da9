"""The server through the official ``openai`` client, checked against ProtectedLM in process
(the same tiny bundle): texts, log-probs, certificates, streaming, echo, n, seeds, chat."""

from __future__ import annotations

import pytest
import torch

from scpdr import methods

#: The served bundle runs SCP-Δr with its base model: the 'b' variant's result-row name.
SCP_B = methods.resolve("scp-delta-r")

PROMPT = "The weather explains the results"


@pytest.fixture(scope="module")
def base_url(start_server):
    with start_server(max_batch=8) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(lm, text: str) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=True)["input_ids"])


def _naf(choice) -> dict:
    return choice.model_extra["naf"]


def test_models_lists_the_served_model(client, model_id, serve_lm):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    assert models[0].model_extra["naf"]["method"] == serve_lm.method == SCP_B.rule
    assert models[0].model_extra["naf"]["name"] == SCP_B.name
    assert client.models.retrieve(model_id).id == model_id


def test_greedy_completion_equals_protected_lm(client, model_id, serve_lm):
    out = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    ref = serve_lm.generate([PROMPT], max_new_tokens=8, temperature=0.0, top_logprobs=3)[0]
    (choice,) = out.choices
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert choice.logprobs.tokens == [
        serve_lm.tokenizer.decode([t]) for t in ref.token_ids
    ]  # ASCII-only tokens here
    for top, chosen, lp, ref_top in zip(
        choice.logprobs.top_logprobs,
        choice.logprobs.tokens,
        choice.logprobs.token_logprobs,
        ref.top_logprobs,
        strict=True,
    ):
        assert top[chosen] == lp  # the chosen token is always in the dict
        assert 3 <= len(top) <= 4
        best = max(v for _, v in ref_top)
        assert max(top.values()) == pytest.approx(best, abs=1e-5)
    naf = _naf(choice)
    assert naf["method"] == SCP_B.rule and naf["m"] == 10 and naf["name"] == SCP_B.name
    assert naf["k_x"] == pytest.approx(ref.k_x, abs=1e-6)
    assert naf["t_x"] == pytest.approx(ref.t_x, abs=1e-6)
    assert naf["max_k_x"] == pytest.approx(max(ref.k_x), abs=1e-6)
    assert naf["max_t_x"] == pytest.approx(max(ref.t_x), abs=1e-6)
    assert out.usage.prompt_tokens == len(_ids(serve_lm, PROMPT))
    assert out.usage.completion_tokens == len(ref.token_ids) == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_stream_text_and_certificate_equal_the_non_streamed(client, model_id):
    kw = dict(model=model_id, prompt=[PROMPT, "My friend asks about"], max_tokens=10, temperature=0)
    full = client.completions.create(**kw, logprobs=1)
    texts, k_x, finish, usage = {}, {}, {}, None
    lps: dict[int, list[float]] = {}
    for chunk in client.completions.create(
        **kw, logprobs=1, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        k_x.setdefault(c.index, []).extend(_naf(c)["k_x"])
        if c.logprobs is not None:
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason
            assert _naf(c)["max_k_x"] == _naf(full.choices[c.index])["max_k_x"]
    for c in full.choices:
        assert texts[c.index] == c.text
        assert k_x[c.index] == _naf(c)["k_x"]
        assert lps[c.index] == c.logprobs.token_logprobs
        assert finish[c.index] == c.finish_reason
    assert usage is not None and usage.model_dump() == full.usage.model_dump()


def test_echo_with_max_tokens_0_and_1_scores_the_prompt(client, model_id, serve_lm):
    ids = _ids(serve_lm, PROMPT)
    ref = serve_lm.score(torch.tensor([ids]), full=True, k_x=True)
    ref_lp = ref.token_logprobs[0].tolist()
    zero = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
    ).choices[0]
    assert zero.text == PROMPT and zero.finish_reason == "length"
    assert zero.logprobs.token_logprobs[0] is None and zero.logprobs.top_logprobs[0] is None
    assert zero.logprobs.token_logprobs[1:] == pytest.approx(ref_lp, abs=1e-5)
    assert len(zero.logprobs.tokens) == len(ids)
    assert "".join(zero.logprobs.tokens) == PROMPT
    assert zero.logprobs.text_offset[0] == 0
    assert zero.logprobs.text_offset[-1] == len(PROMPT) - len(zero.logprobs.tokens[-1])
    best = ref.logprobs[0].max(-1).values.tolist()
    for top, b in zip(zero.logprobs.top_logprobs[1:], best, strict=True):
        assert max(top.values()) == pytest.approx(b, abs=1e-5)
    naf = _naf(zero)
    assert naf["k_x"] == [] and naf["prompt_k_x"][0] is None
    assert naf["prompt_k_x"][1:] == pytest.approx(ref.k_x[0].tolist(), abs=1e-6)

    one = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0
    ).choices[0]
    gen = serve_lm.generate([PROMPT], max_new_tokens=1)[0]
    assert one.text == PROMPT + gen.text
    assert len(one.logprobs.token_logprobs) == len(ids) + 1
    assert one.logprobs.token_logprobs[1:-1] == pytest.approx(ref_lp, abs=1e-5)
    assert one.logprobs.token_logprobs[-1] == pytest.approx(gen.logprobs[0], abs=1e-5)
    # lm-eval's is_greedy test: a greedy token's value equals the best alternative's, exactly
    greedy = ref.logprobs[0].argmax(-1).tolist()
    for i, (lp, top) in enumerate(
        zip(one.logprobs.token_logprobs[1:-1], one.logprobs.top_logprobs[1:-1], strict=True)
    ):
        assert (lp == max(top.values())) == (greedy[i] == ids[i + 1])


def test_token_id_prompts_are_used_exactly(client, model_id, serve_lm):
    ids = [504, 3327, 9541, 260]  # no BOS is added
    out = client.completions.create(
        model=model_id, prompt=[ids, ids[:2]], max_tokens=0, echo=True, logprobs=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == serve_lm.tokenizer.decode(ids)
    assert out.choices[0].logprobs.tokens == [serve_lm.tokenizer.decode([t]) for t in ids]
    ref = serve_lm.score(torch.tensor([ids]))[0].tolist()
    assert out.choices[0].logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-5)
    assert all(len(d) == 1 for d in out.choices[0].logprobs.top_logprobs[1:])
    assert out.usage.prompt_tokens == 6
    single = client.completions.create(model=model_id, prompt=ids, max_tokens=3, temperature=0)
    assert single.choices[0].text == serve_lm.generate([ids], max_new_tokens=3)[0].text


def test_n_choices_follow_seed_plus_index_and_reproduce(client, model_id, serve_lm):
    kw = dict(model=model_id, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    refs = serve_lm.generate([PROMPT] * 3, max_new_tokens=6, temperature=1.0, seed=[7, 8, 9])
    assert [c.text for c in a.choices] == [r.text for r in refs]
    other = client.completions.create(**{**kw, "seed": 8, "n": 1})
    assert other.choices[0].text == a.choices[1].text  # choice j uses seed + j
    assert a.usage.completion_tokens == sum(len(r.token_ids) for r in refs)


def test_stop_string_cuts_the_text(client, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop, "zzzz-never"]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def test_chat_completion_and_stream(client, model_id, serve_lm):
    messages = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    prompt = serve_lm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = serve_lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref = serve_lm.generate([ids], max_new_tokens=6, top_logprobs=2)[0]
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-5)
    for t, ref_top in zip(choice.logprobs.content, ref.top_logprobs, strict=True):
        assert len(t.top_logprobs) == 2
        assert [a.logprob for a in t.top_logprobs] == pytest.approx([v for _, v in ref_top])
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or t.token.startswith("bytes:")
    assert _naf(choice)["k_x"] == pytest.approx(ref.k_x, abs=1e-6)
    assert out.usage.prompt_tokens == len(ids)

    legacy = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=6, temperature=0
    )
    assert legacy.choices[0].message.content == ref.text
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
