"""What :class:`scpdr.runtime.ProtectedLM` returns: generations, streamed events, teacher-forced
scores, and whether the shared-base fast path runs.

Every certificate travels with its token: ``k_x`` is the NAF bound of the method at that position
(Def. 2.1, Thms. 2.3/2.7; for SCP-Δr on the smoothed distributions, §4.1), ``t_x`` the LiRA
bound of Thm. 4.4 (max over all constituents), both from :func:`scpdr.bounds.certify`, and
``cost`` the accountant's charge (:func:`scpdr.bounds.token_cost`): at least the realized
log-likelihood ratio of every token the client sees at that position, at most ``t_x``. A
response's certificate is the sum of its charges (``docs/accountant.md``, Proposition 1).
``anchor`` is the same charge against the (floored) base model, when the row measures it
(anchored, falling back to the base, or budgeted, on a model with a base: Propositions 3-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

__all__ = [
    "FastPath",
    "Generation",
    "PromptLogprobs",
    "ScoreComponents",
    "ScoreOutput",
    "StepEvent",
]


@dataclass(frozen=True)
class PromptLogprobs:
    """Teacher-forced log-probs of a prompt under the aggregate r (``echo``).

    Lists have ``len(prompt) - 1`` entries: entry i is about prompt token i + 1, read from the
    distribution a fresh request of ``prompt[:i+1]`` gets (CP-Fuse: path length 0, the TDE game
    of Def. 4.2). ``top_logprobs[i]`` holds ``(token_id, logprob)`` of the most likely tokens,
    best first (empty lists when no alternatives were asked for). ``cost[i]`` is the position's
    charge (the prompt token and its alternatives are revealed). Under a ``budget`` the lists
    stop before the first position whose charge would take the response past it
    (:attr:`served` < ``len(prompt) - 1``: the rest is withheld), or with ``on_budget="base"``
    positions from ``fallback_at`` on hold the base model's log-probs (certificate and charge 0,
    :meth:`with_fallback`). ``anchor[i]`` is the position's charge against the base (empty when
    the row does not measure it).
    """

    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    k_x: list[float]
    t_x: list[float]
    cost: list[float] = field(default_factory=list)
    anchor: list[float] = field(default_factory=list)
    fallback_at: int | None = None

    @property
    def served(self) -> int:
        """Prompt positions whose log-probs are served."""
        return len(self.token_logprobs)

    def truncated(self, n: int) -> PromptLogprobs:
        """The first ``n`` positions only (what a budget serves)."""
        return PromptLogprobs(
            self.token_logprobs[:n],
            self.top_logprobs[:n],
            self.k_x[:n],
            self.t_x[:n],
            self.cost[:n],
            self.anchor[:n],
        )

    def with_fallback(self, n: int, base: PromptLogprobs) -> PromptLogprobs:
        """The first ``n`` positions from the private aggregate, the rest from ``base`` (the
        base model's log-probs of the same prompt) with certificate and charges 0: what
        ``on_budget="base"`` serves when position ``n`` is the first the budget cannot serve."""
        m = len(self.token_logprobs)
        if n >= m:
            return self
        zeros = [0.0] * (m - n)
        return PromptLogprobs(
            self.token_logprobs[:n] + base.token_logprobs[n:m],
            self.top_logprobs[:n] + base.top_logprobs[n:m],
            self.k_x[:n] + zeros,
            self.t_x[:n] + zeros,
            self.cost[:n] + zeros,
            self.anchor[:n] + zeros if self.anchor else [],
            n,
        )


@dataclass
class Generation:
    """One prompt's generation. ``token_ids``, ``logprobs``, ``k_x``, ``t_x``, ``cost`` (and
    ``top_logprobs`` when requested) have one entry per generated token.

    ``logprobs`` are log r(y) of the aggregated distribution (before temperature/top-p/top-k);
    ``text`` is the decoded generation without special tokens, cut before a stop string when one
    matched (the token that completed it stays in ``token_ids``); ``finish_reason`` is "stop"
    (eos or a stop string), "length", or "budget" (the next token's charge would have taken the
    response past the ``budget``: it was not emitted). ``prompt_logprobs`` is set when the
    sampling parameters ask for ``echo``. ``cost[t]`` is token t's charge
    (:func:`scpdr.bounds.token_cost`); :attr:`sum_cost` is the response's certificate.

    With ``on_budget="base"``, tokens from ``fallback_at`` on were drawn from the base model
    (their ``logprobs`` are the base's; ``k_x``, ``t_x``, ``cost`` are 0: ``docs/accountant.md``,
    Proposition 3) and ``finish_reason`` stays "stop"/"length"; ``fallback_at`` is None when every
    token was private (:attr:`private_tokens`). ``anchor[t]`` is token t's charge against the
    base (None when the row does not measure it), :attr:`sum_anchor` the response's certificate
    against the base (Proposition 4).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    k_x: list[float]
    t_x: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str = "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    cost: list[float] = field(default_factory=list)
    anchor: list[float] | None = None
    fallback_at: int | None = None

    @property
    def private_tokens(self) -> int:
        """Generated tokens served from the private aggregate (before any fallback)."""
        return len(self.token_ids) if self.fallback_at is None else self.fallback_at

    @property
    def sum_anchor(self) -> float | None:
        """The response's certificate against the base: ``Σ anchor`` over its tokens and served
        prompt positions (``docs/accountant.md``, Proposition 4); None when not measured."""
        if self.anchor is None:
            return None
        echoed = self.prompt_logprobs.anchor if self.prompt_logprobs is not None else []
        return math.fsum([*echoed, *self.anchor])

    @property
    def sum_cost(self) -> float:
        """The response's certificate: ``Σ cost`` over its tokens and its served (echoed) prompt
        positions; the log-likelihood ratio of everything served against every constituent is at
        most this (``docs/accountant.md``, Proposition 1). ``+inf`` without a certificate."""
        echoed = self.prompt_logprobs.cost if self.prompt_logprobs is not None else []
        return math.fsum([*echoed, *self.cost])

    @property
    def sum_t_x(self) -> float:
        """The worst case of :attr:`sum_cost`: ``Σ t_x`` over the same positions."""
        echoed = self.prompt_logprobs.t_x if self.prompt_logprobs is not None else []
        return math.fsum([*echoed, *self.t_x])


@dataclass
class StepEvent:
    """One streamed event of :meth:`ProtectedLM.generate_stream`, for prompt ``index``.

    Each generated token gives one event (``token_id`` set); a row's last event has
    ``finish_reason`` set. ``text_delta`` is the newly safe-to-show text (text that could still
    turn into a stop string or an incomplete UTF-8 character is held back). With
    ``max_new_tokens=0`` a row's only event has ``token_id=None``. A row with ``echo`` first gets
    one event with ``prompt`` set (and ``token_id=None``, ``finish_reason=None``). A row stopped
    by its budget ends with an event with ``token_id=None`` and ``finish_reason="budget"`` (the
    withheld token is never shown). ``cost`` is the token's charge, ``anchor`` its charge
    against the base (None when not measured), ``fallback`` whether it was drawn from the base
    (``on_budget="base"``).
    """

    index: int
    token_id: int | None
    text_delta: str
    logprob: float | None
    k_x: float | None
    t_x: float | None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    prompt: PromptLogprobs | None = None
    cost: float | None = None
    anchor: float | None = None
    fallback: bool = False


class ScoreComponents(NamedTuple):
    """Raw inputs of the aggregation, for in-process bound analysis (never served).

    ``logps``: ``Tensor[K', B, T-1, V]`` float32 log-softmax of the models actually run
    (K' = 1 for "none"); ``base``: ``Tensor[B, T-1, V]`` base log-probs ('b'), the constant
    ``Tensor[V]`` base logits ('c'), or None. Pass them to ``scpdr.bounds`` with the same method.
    """

    logps: Tensor
    base: Tensor | None


@dataclass
class ScoreOutput:
    """Teacher-forced outputs of :meth:`ProtectedLM.score`; position t predicts token t+1.

    ``token_logprobs`` ``(B, T-1)``; ``logprobs`` ``(B, T-1, V)`` when ``full``; ``greedy``
    ``(B, T-1)`` argmax of r (-1 where invalid); ``k_x``/``t_x`` ``(B, T-1)``; ``components``
    (see :class:`ScoreComponents`); ``top_logprobs``/``top_ids`` ``(B, T-1, n)`` the n most likely
    tokens of r, best first; ``cost`` ``(B, T-1)`` each position's charge when its target and the
    n alternatives are revealed (:func:`scpdr.bounds.token_cost`). Positions whose context or
    target is padding hold 0.0 (ids: -1). With ``anchor=c`` every value is that of the anchored
    distribution (:func:`scpdr.bounds.anchor`). ``anchor`` ``(B, T-1)``: the same charge against
    the floored base; ``base_token_logprobs`` ``(B, T-1)``, ``base_top_logprobs``/``base_top_ids``
    ``(B, T-1, n)``: the base model's own (what a fallback position serves).
    """

    token_logprobs: Tensor
    logprobs: Tensor | None = None
    greedy: Tensor | None = None
    k_x: Tensor | None = None
    components: ScoreComponents | None = None
    t_x: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    cost: Tensor | None = None
    anchor: Tensor | None = None
    base_token_logprobs: Tensor | None = None
    base_top_logprobs: Tensor | None = None
    base_top_ids: Tensor | None = None


@dataclass(frozen=True)
class FastPath:
    """Whether the shared-base fast path runs (one stacked forward of a base for every LoRA
    constituent, ``scpdr.lora``) and why, or why not. ``bool(fast_path)`` is ``on``."""

    on: bool
    reason: str

    def __bool__(self) -> bool:
        return self.on

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'}: {self.reason}"
