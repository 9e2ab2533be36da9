"""Wire-format helpers: certificates, log-prob clamping, seeds, token bytes/offsets, validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.serve import protocol as P
from scpdr.serve.app import TokenText, seed_for


def test_logprob_value_clamps_what_json_cannot_carry():
    assert P.logprob_value(-math.inf) == P.LOGPROB_FLOOR == -9999.0
    assert P.logprob_value(math.nan) == -9999.0
    assert P.logprob_value(-1e6) == -9999.0
    assert P.logprob_value(-1.5) == -1.5
    assert P.logprob_value(1e-7) == 0.0  # rounding above 0 is clamped
    assert P.finite_or_none(math.inf) is None and P.finite_or_none(0.25) == 0.25


def _cert(k, t, **kw):
    return P.NafCertificate.build(
        method="scp-delta-r", m=10, name="scp-delta-r-b", k_x=k, t_x=t, **kw
    )


def test_certificate_maxima_and_infinite_bounds():
    c = _cert([0.1, 0.3, 0.2], [1.0, 0.5, 2.0])
    assert (c.max_k_x, c.max_t_x) == (0.3, 2.0)
    inf = _cert([0.1, math.inf], [1.0, math.inf])
    assert inf.k_x == [0.1, None] and inf.max_k_x is None and inf.max_t_x is None
    empty = _cert([], [])
    assert empty.max_k_x is None and empty.k_x == []
    echo = _cert([0.1], [1.0], prompt_k_x=[None, 0.7], prompt_t_x=[None, 3.0])
    assert (echo.max_k_x, echo.max_t_x) == (0.7, 3.0) and echo.prompt_k_x == [None, 0.7]


@given(st.lists(st.floats(0, 50), min_size=1, max_size=12))
def test_streamed_certificates_concatenate_to_the_whole(k):
    t = [2 * v for v in k]
    whole = _cert(k, t)
    parts = [_cert(k[: i + 1], t[: i + 1], listed=slice(i, i + 1)) for i in range(len(k))]
    assert [v for p in parts for v in p.k_x] == whole.k_x
    assert [v for p in parts for v in p.t_x] == whole.t_x
    assert [p.max_k_x for p in parts] == [max(k[: i + 1]) for i in range(len(k))]  # running
    assert parts[-1].max_t_x == whole.max_t_x == max(t)


@given(st.integers(-(2**63), 2**63 - 1), st.integers(0, P.MAX_N))
def test_seed_for_stays_in_int64(seed, j):
    s = seed_for(seed, j)
    assert -(2**63) <= s < 2**63
    assert (s - seed - j) % 2**64 == 0
    assert seed_for(None, j) is None


@pytest.fixture(scope="module")
def text():
    from scpdr.testing import tiny_tokenizer

    return TokenText(tiny_tokenizer())


def test_token_strings_of_partial_utf8_are_bytes_escapes(text):
    ids = text.tokenizer.encode(" 日本")  # the first character spans three tokens
    pieces = [text.str(i) for i in ids]
    assert len(ids) == 4 and pieces[-1] == "本"
    assert pieces[0] == "bytes:\\x20\\xe6"  # OpenAI's convention for a partial character
    assert all(p.startswith("bytes:") for p in pieces[:3])
    assert b"".join(text.bytes(i) for i in ids).decode() == " 日本"
    assert text.offsets(ids) == [0, 1, 1, 2]  # ' 日' completes at the third token


@settings(max_examples=40, deadline=None)
@given(
    st.text(
        alphabet=st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs", "Co", "Cn", "Cc"]),
        max_size=30,
    )
)
def test_token_bytes_concatenate_to_the_text(text, s):
    ids = text.tokenizer(s, add_special_tokens=False)["input_ids"]
    decoded = text.tokenizer.decode(ids)  # the normalizer drops a few control characters
    assert b"".join(text.bytes(i) for i in ids) == decoded.encode()
    offsets = text.offsets(ids)
    assert offsets == sorted(offsets) and all(0 <= o <= len(decoded) for o in offsets)


def test_completion_request_validation():
    r = P.CompletionRequest(prompt=[[1, 2], [3]], stop="x")
    assert r.prompts() == [[1, 2], [3]] and r.stop_list() == ["x"]
    assert P.CompletionRequest(prompt=[5, 6]).prompts() == [[5, 6]]
    assert P.CompletionRequest(prompt="a", stop=["", "b"]).stop_list() == ["b"]
    assert P.CompletionRequest(prompt="a").effective_temperature() == 1.0  # OpenAI's default
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
