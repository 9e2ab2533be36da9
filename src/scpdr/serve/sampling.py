"""How to decode one sequence: the server's one sampling-parameter type.

A request's :meth:`~scpdr.serve.protocol.CompletionRequest.to_sampling_params` builds one
:class:`SamplingParams` per prompt and choice; the :class:`~scpdr.serve.engine.Engine` reads
nothing else. The fields (and their names) are those of the runtime's sampling type
(``scpdr.runtime.sampling.SamplingParams``, per sequence), so the server can switch to that type by
changing its import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Decoding settings of one sequence (one prompt, one choice), validated at construction.

    Attributes:
        max_new_tokens: tokens to generate (0: none, e.g. an echo that only scores the prompt).
        temperature: 0 is greedy decoding.
        top_p: nucleus sampling, in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; 0 is off.
        stop: stop strings; the text ends before the first one (which is not returned).
        seed: the sequence's own generator seed (``None``: drawn from torch's global RNG).
        logprobs: ``None`` = no log-probs; ``k >= 0`` = the chosen token's log-prob under the
            aggregate plus the ``k`` most likely alternatives at every served position.
        echo: the prompt is returned too; with ``logprobs`` its positions are scored (position
            i > 0 gets log r(prompt[i] | prompt[:i]) and its certificate).
        stop_at_eos: finish at the end-of-sequence token.

    Raises:
        ValueError: a field out of its range (the message names the field).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a tuple of strings, got {self.stop!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
