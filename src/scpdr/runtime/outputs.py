"""What :class:`scpdr.runtime.ProtectedLM` returns: generations, streamed events, teacher-forced
scores, and whether the shared-base fast path runs.

Every certificate travels with its token: ``k_x`` is the NAF bound of the method at that position
(Def. 2.1, Thms. 2.3/2.7; for SCP-Δr on the smoothed distributions, §4.1) and ``t_x`` the LiRA
bound of Thm. 4.4 (max over all constituents), both from :func:`scpdr.bounds.certify`.
"""

from __future__ import annotations

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
    best first (empty lists when no alternatives were asked for).
    """

    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    k_x: list[float]
    t_x: list[float]


@dataclass
class Generation:
    """One prompt's generation. ``token_ids``, ``logprobs``, ``k_x``, ``t_x`` (and
    ``top_logprobs`` when requested) have one entry per generated token.

    ``logprobs`` are log r(y) of the aggregated distribution (before temperature/top-p/top-k);
    ``text`` is the decoded generation without special tokens, cut before a stop string when one
    matched (the token that completed it stays in ``token_ids``); ``finish_reason`` is "stop"
    (eos or a stop string) or "length". ``prompt_logprobs`` is set when the sampling parameters
    ask for ``echo``.
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


@dataclass
class StepEvent:
    """One streamed event of :meth:`ProtectedLM.generate_stream`, for prompt ``index``.

    Each generated token gives one event (``token_id`` set); a row's last event has
    ``finish_reason`` set. ``text_delta`` is the newly safe-to-show text (text that could still
    turn into a stop string or an incomplete UTF-8 character is held back). With
    ``max_new_tokens=0`` a row's only event has ``token_id=None``. A row with ``echo`` first gets
    one event with ``prompt`` set (and ``token_id=None``, ``finish_reason=None``).
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
    tokens of r, best first. Positions whose context or target is padding hold 0.0 (ids: -1).
    """

    token_logprobs: Tensor
    logprobs: Tensor | None = None
    greedy: Tensor | None = None
    k_x: Tensor | None = None
    components: ScoreComponents | None = None
    t_x: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None


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
