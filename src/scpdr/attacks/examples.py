"""What a membership attack scores of one example: its token IDs and the first scored token
(§4.2: the adversary holds a prefix ``x`` and asks about the continuation ``y``).

- a ``(prompt, response)`` pair, or a record / canary with a ``prompt``: only the response is
  scored, given the prompt (Names2IDs: the ID digits given ``"Name: <name>, ID:"``, the PII
  game of §5.1; a canary: its words given its prefix);
- a plain text or a token list: every token after the first (each given the ones before it, as
  in TTE).

Members and non-members go through the same rule; ``max_tokens`` truncates the full example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scpdr.attacks.pii import common_prefix
from scpdr.attacks.scorer import batched_token_logprobs, encode
from scpdr.errors import ConfigError

__all__ = ["cached_token_logprobs", "example_ids", "prompt_response"]


def prompt_response(x: Any) -> tuple[str, str] | None:
    """``(prompt, full text)`` of a prompted example, ``None`` for a plain text / token list."""
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(v, str) for v in x):
        prompt, response = x
        return (prompt, prompt + response) if prompt else None
    prompt = getattr(x, "prompt", None)
    if not isinstance(prompt, str) or not prompt:
        return None
    text = getattr(x, "text", None)
    if isinstance(text, str) and text.startswith(prompt):
        return prompt, text  # what the constituent was trained on
    return prompt, prompt + str(getattr(x, "response", None) or "")


def example_ids(
    tokenizer: Any, x: Any, *, max_tokens: int | None = None, label: str = "example"
) -> tuple[list[int], int]:
    """``(token IDs, index of the first scored token)`` of one example (see the module)."""
    if isinstance(x, str):
        ids, start = encode(tokenizer, x), 1
    elif (pr := prompt_response(x)) is not None:
        prompt, full = pr
        ids, p_ids = encode(tokenizer, full), encode(tokenizer, prompt)
        # skip the tokens the prompt and the full text share (a merge at the seam is scored)
        start = max(common_prefix(ids, p_ids), 1)
    elif isinstance(x, Sequence) and all(isinstance(v, (int, np.integer)) for v in x):
        ids, start = [int(v) for v in x], 1
    else:
        text = getattr(x, "text", None)
        if not isinstance(text, str):
            raise ConfigError(
                f"{label} is a {type(x).__name__}: pass a text, a token list, a "
                "(prompt, response) pair or a record with prompt/response or text"
            )
        ids, start = encode(tokenizer, text), 1
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) <= start:
        raise ConfigError(
            f"{label} has no token to score ({len(ids)} tokens; scored tokens start at "
            f"index {start}{'' if max_tokens is None else f', max_tokens={max_tokens}'}): give it a "
            "non-empty response / at least 2 tokens, or raise max_tokens"
        )
    return ids, start


def cached_token_logprobs(
    scorer: Any, seqs: list[list[int]], *, batch_size: int, cache: dict | None
) -> list[Any]:
    """:func:`~scpdr.attacks.scorer.batched_token_logprobs` (each prefix a fresh request),
    remembered in ``cache`` (a dict kept across calls that share a scorer object, e.g. the base
    model or LiRA's reference for every method). The entry keeps the scorer itself alive, so its
    ``id()`` cannot be reused by a later scorer while the entry exists."""
    key = ("token-logprobs", id(scorer), tuple(map(tuple, seqs)))
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        return hit[1]
    out = batched_token_logprobs(scorer, seqs, batch_size=batch_size)
    if cache is not None:
        cache[key] = (scorer, out)
    return out
