"""Tokens as the API shows them: their text and bytes, character offsets, and the log-prob
payloads of both endpoints (the legacy completions shape and the chat list shape).

Every log-prob here is log r(y|x) of the aggregate (the engine sends nothing else), before
temperature, top-p and top-k.
"""

from __future__ import annotations

import codecs
import functools
import math
import threading
from collections.abc import Sequence
from typing import Any

from scpdr.serve.engine import PromptLogprobs, TokenOutput
from scpdr.serve.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

__all__ = [
    "LOGPROB_FLOOR",
    "TokenText",
    "chat_logprobs",
    "completion_logprobs",
    "logprob_value",
]

#: JSON cannot carry -inf; like OpenAI and vLLM, an impossible token's log-prob is sent as -9999.0.
LOGPROB_FLOOR = -9999.0


def logprob_value(x: float) -> float:
    """A log-prob as JSON can carry it: -inf (and NaN) → :data:`LOGPROB_FLOOR`, others clamped."""
    x = float(x)
    if math.isnan(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(x, 0.0)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (byte-level BPE: each char stands for one byte)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Per-token strings and bytes for log-prob payloads (cached; give it its own tokenizer copy:
    a fast tokenizer is not safe to share across threads)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)
        self.str = functools.lru_cache(maxsize=65536)(self._str)

    def _bytes(self, token_id: int) -> bytes:
        with self._lock:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            if piece is None:
                return b""
            dec = _byte_decoder()
            if all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
            return self.tokenizer.decode([int(token_id)]).encode("utf-8")

    def _str(self, token_id: int) -> str:
        """The token's text; a token that is not valid UTF-8 on its own is ``bytes:\\xNN...``
        (OpenAI's convention), so distinct tokens keep distinct keys."""
        b = self.bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def offsets(self, token_ids: Sequence[int], *, start: int = 0) -> list[int]:
        """Character offset of each token in the decoded text of ``token_ids`` (plus ``start``)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, pos = [], start
        for t in token_ids:
            out.append(pos)
            pos += len(decoder.decode(self.bytes(t)))
        return out

    def top_dict(
        self, top: Sequence[tuple[int, float]], k: int, chosen: int, chosen_lp: float
    ) -> dict[str, float]:
        """Legacy ``top_logprobs`` entry: the ``k`` best alternatives plus the chosen token (so
        lm-eval's ``is_greedy`` test, which compares the chosen value with the best, works)."""
        d = {self.str(t): logprob_value(lp) for t, lp in list(top)[:k]}
        d[self.str(chosen)] = logprob_value(chosen_lp)
        return d


def completion_logprobs(
    text: TokenText,
    tokens: Sequence[TokenOutput],
    *,
    k: int,
    prompt_ids: Sequence[int] = (),
    prompt_logprobs: PromptLogprobs | None = None,
    start: int = 0,
) -> CompletionLogprobs:
    """The legacy completions shape over ``prompt_ids`` (echo; entry 0 is null: no context, and
    every prompt entry is null when the prompt was not scored, or was withheld by the budget:
    past ``prompt_logprobs.served``) then ``tokens``; text offsets count from ``start``."""
    ids: list[int] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for i, t in enumerate(prompt_ids):
        ids.append(t)
        if i == 0 or prompt_logprobs is None or i > prompt_logprobs.served:
            token_lps.append(None)
            tops.append(None)
        else:
            lp = prompt_logprobs.token_logprobs[i - 1]
            token_lps.append(logprob_value(lp))
            tops.append(text.top_dict(prompt_logprobs.top_logprobs[i - 1], k, t, lp))
    for tok in tokens:
        ids.append(tok.token_id)
        token_lps.append(logprob_value(tok.logprob))
        tops.append(text.top_dict(tok.top_logprobs, k, tok.token_id, tok.logprob))
    return CompletionLogprobs(
        tokens=[text.str(t) for t in ids],
        token_logprobs=token_lps,
        top_logprobs=tops,
        text_offset=text.offsets(ids, start=start),
    )


def chat_logprobs(text: TokenText, tokens: Sequence[TokenOutput], k: int) -> ChatLogprobs:
    """The chat shape: per token its text, log-prob, bytes and its ``k`` best alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=text.str(t.token_id),
                logprob=logprob_value(t.logprob),
                bytes=list(text.bytes(t.token_id)),
                top_logprobs=[
                    TopLogprob(
                        token=text.str(a), logprob=logprob_value(lp), bytes=list(text.bytes(a))
                    )
                    for a, lp in list(t.top_logprobs)[:k]
                ],
            )
            for t in tokens
        ]
    )
