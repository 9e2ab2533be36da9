"""Compatibility re-export: the runtime moved to :mod:`scpdr.runtime` (``ProtectedLM`` in
:mod:`scpdr.runtime.protected`). Kept so that ``scpdr.protected.*`` imports keep working until
the lead removes this module after the merge."""

from __future__ import annotations

from scpdr.runtime import (
    METHODS,
    SCORE_CHUNK_ELEMENTS,
    FastPath,
    Generation,
    PromptLogprobs,
    ProtectedLM,
    SamplingParams,
    ScoreComponents,
    ScoreOutput,
    StepEvent,
)

__all__ = [
    "METHODS",
    "SCORE_CHUNK_ELEMENTS",
    "FastPath",
    "Generation",
    "PromptLogprobs",
    "ProtectedLM",
    "SamplingParams",
    "ScoreComponents",
    "ScoreOutput",
    "StepEvent",
]
