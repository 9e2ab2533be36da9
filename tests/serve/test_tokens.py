"""Tokens as the API shows them: log-prob clamping, token text and bytes, offsets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scpdr.serve.tokens import LOGPROB_FLOOR, TokenText, logprob_value


def test_logprob_value_clamps_what_json_cannot_carry():
    assert logprob_value(-math.inf) == LOGPROB_FLOOR == -9999.0
    assert logprob_value(math.nan) == -9999.0
    assert logprob_value(-1e6) == -9999.0
    assert logprob_value(-1.5) == -1.5
    assert logprob_value(1e-7) == 0.0  # rounding above 0 is clamped


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
