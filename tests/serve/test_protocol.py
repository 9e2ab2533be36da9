"""The wire format: request validation and the sampling parameters a request builds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scpdr.runtime import SamplingParams
from scpdr.serve import protocol as P


@given(st.integers(-(2**63), 2**63 - 1), st.integers(0, P.MAX_N))
def test_seed_for_stays_in_int64(seed, j):
    s = P.seed_for(seed, j)
    assert -(2**63) <= s < 2**63
    assert (s - seed - j) % 2**64 == 0
    assert P.seed_for(None, j) is None


def test_completion_request_validation():
    r = P.CompletionRequest(prompt=[[1, 2], [3]], stop="x")
    assert r.prompts() == [[1, 2], [3]] and r.stop_list() == ["x"]
    assert P.CompletionRequest(prompt=[5, 6]).prompts() == [[5, 6]]
    assert P.CompletionRequest(prompt="a", stop=["", "b"]).stop_list() == ["b"]
    for bad in ({"prompt": [True]}, {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "n": 99}):
        with pytest.raises(ValueError):
            P.CompletionRequest(**bad)
    assert P.CompletionRequest(prompt="a", max_tokens=0, echo=True).max_tokens == 0
    chat = P.ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        max_tokens=3,
        max_completion_tokens=5,
    )
    assert chat.messages[0].text() == "ab" and chat.max_new_tokens() == 5


def test_completion_to_sampling_params_fills_openais_defaults():
    params = P.CompletionRequest(prompt="a").to_sampling_params(max_new_tokens=16)
    assert params == SamplingParams(max_new_tokens=16, temperature=1.0)  # OpenAI's default: 1
    req = P.CompletionRequest(
        prompt="a",
        temperature=0,
        top_p=0.5,
        top_k=-1,
        stop=["", "x"],
        seed=7,
        logprobs=3,
        echo=True,
    )
    assert req.to_sampling_params(max_new_tokens=4, choice=2) == SamplingParams(
        max_new_tokens=4,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        stop=("x",),
        seed=9,
        logprobs=3,
        echo=True,
    )  # top_k -1 is off; choice j samples with seed + j
    assert P.CompletionRequest(prompt="a", top_k=5).to_sampling_params(max_new_tokens=1).top_k == 5
    # echo without logprobs returns the prompt's text alone: the runtime scores nothing
    text_only = P.CompletionRequest(prompt="a", max_tokens=0, echo=True)
    assert text_only.to_sampling_params(max_new_tokens=0).echo is False


def test_chat_to_sampling_params():
    msg = [{"role": "user", "content": "hi"}]
    plain = P.ChatCompletionRequest(messages=msg).to_sampling_params(max_new_tokens=3)
    assert plain.logprobs is None and plain.echo is False and plain.max_new_tokens == 3
    top = P.ChatCompletionRequest(messages=msg, logprobs=True, top_logprobs=4)
    assert top.to_sampling_params(max_new_tokens=1).logprobs == 4
    chosen_only = P.ChatCompletionRequest(messages=msg, logprobs=True)
    assert chosen_only.to_sampling_params(max_new_tokens=1).logprobs == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_k": -2},
        {"seed": 2**63},
        {"logprobs": 21},
        {"stop": 5},
    ],
)
def test_sampling_fields_out_of_range_are_rejected_before_any_model(bad):
    with pytest.raises(ValueError):
        P.CompletionRequest(prompt="a", **bad)
