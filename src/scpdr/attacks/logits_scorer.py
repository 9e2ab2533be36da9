""":class:`LogitsScorer`: any ``logits_fn(input_ids, attention_mask) -> Tensor[B, T, V]`` as a
:class:`~scpdr.attacks.scorer.Scorer`.

Tests use it with hand-written distributions (a model that has memorized its data exactly, a
uniform model, a random bigram model) whose attack results are known in closed form. It is
stateless: every position is a fresh request whatever ``prompt_lengths`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from scpdr.attacks.scorer import encode

__all__ = ["LogitsScorer", "ScoreResult", "SimpleGeneration"]


@dataclass
class ScoreResult:
    """What :meth:`LogitsScorer.score` returns when a flag is set (the field names of
    ``scpdr.runtime.ScoreOutput``)."""

    token_logprobs: Tensor
    logprobs: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    components: Any = None


@dataclass
class SimpleGeneration:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    k_x: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_token_ids: list[int] = field(default_factory=list)


class LogitsScorer:
    """A :class:`~scpdr.attacks.scorer.Scorer` over ``logits_fn(input_ids[B, T],
    attention_mask[B, T]) -> Tensor[B, T, V]`` (next-token logits at every position;
    log-softmaxed here, in float32).

    Padding: ``next_token_logprobs`` reads each row's last real position (left or right padding
    both work); ``score`` expects right padding. No KV cache: meant for tests and small runs.
    """

    def __init__(
        self,
        logits_fn: Callable[[Tensor, Tensor], Tensor],
        tokenizer: Any,
        *,
        name: str = "scorer",
        components_fn: Callable[[Tensor, Tensor], Any] | None = None,
    ) -> None:
        self._logits_fn = logits_fn
        self._components_fn = components_fn
        self.tokenizer = tokenizer
        self.name = name

    def _logprobs(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self._logits_fn(input_ids, attention_mask)  # (B, T, V)
        return torch.log_softmax(logits.float(), dim=-1)

    def next_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """``Tensor[B, V]``: the distribution after each row's last real token."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logp = self._logprobs(input_ids, attention_mask)  # (B, T, V)
        pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        last = torch.where(attention_mask.bool(), pos, -1).max(dim=1).values  # (B,)
        return logp[torch.arange(input_ids.shape[0]), last]

    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        prompt_lengths: Sequence[int] | Tensor | None = None,
        full: bool = False,
        top_logprobs: int = 0,
        components: bool = False,
    ) -> Tensor | ScoreResult:
        """Teacher-forced scores (``prompt_lengths`` is accepted and has no effect: a function
        of the ids is stateless)."""
        del prompt_lengths
        logp = self._logprobs(input_ids, attention_mask)[:, :-1]  # (B, T-1, V)
        tok = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        if not (full or top_logprobs or components):
            return tok
        top_v = top_i = None
        if top_logprobs:
            top_v, top_i = torch.topk(logp, min(int(top_logprobs), logp.shape[-1]), dim=-1)
        comp = None
        if components:
            if self._components_fn is None:
                raise TypeError(f"{self.name}: this scorer has no components")
            comp = self._components_fn(input_ids, attention_mask)
        return ScoreResult(tok, logp if full else None, top_v, top_i, comp)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        **_: Any,
    ) -> list[SimpleGeneration]:
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        outs = []
        for p in prompts:
            prompt = encode(self.tokenizer, p) if isinstance(p, str) else list(p)
            ids, lps, reason = list(prompt), [], "length"
            for _step in range(max_new_tokens):
                logp = self.next_token_logprobs(torch.tensor([ids]))[0]
                if temperature > 0:
                    t = int(
                        torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=gen)
                    )
                else:
                    t = int(logp.argmax())
                ids.append(t)
                lps.append(float(logp[t]))
                if stop_at_eos and eos is not None and t == eos:
                    reason = "stop"
                    break
            new = ids[len(prompt) :]
            outs.append(
                SimpleGeneration(
                    text=self.tokenizer.decode(new),
                    token_ids=new,
                    logprobs=lps,
                    finish_reason=reason,
                    prompt_token_ids=prompt,
                )
            )
        return outs
