"""The runtime of a NAF-protected model (layer 3 of ``shared/DESIGN.md``).

- :mod:`~scpdr.runtime.protected`: :class:`ProtectedLM`, the API (generate, stream, score,
  next-token log-probs, loading);
- :mod:`~scpdr.runtime.outputs`: what it returns (:class:`Generation`, :class:`StepEvent`,
  :class:`ScoreOutput`, :class:`PromptLogprobs`, :class:`FastPath`);
- :mod:`~scpdr.runtime.sampling`: the one :class:`SamplingParams` and batched sampling;
- :mod:`~scpdr.runtime.decoding`: the KV-cached decoding loop;
- :mod:`~scpdr.runtime.scoring`: teacher-forced scoring (prompt-aware for CP-Fuse);
- :mod:`~scpdr.runtime.aggregation`: one position's aggregate and certificate;
- :mod:`~scpdr.runtime.modes`: serving from the base (the fallback past a budget, the anchor);
- :mod:`~scpdr.runtime.stop_strings`: stop strings and incremental detokenization;
- :mod:`~scpdr.runtime.inputs`: checking prompts and padded batches;
- :mod:`~scpdr.runtime.runner`: the model-runner protocol and the per-model runner;
- :mod:`~scpdr.runtime.loading`: a bundle's models and the runner chosen for them.
"""

from __future__ import annotations

from scpdr.runtime.outputs import (
    FastPath,
    Generation,
    PromptLogprobs,
    ScoreComponents,
    ScoreOutput,
    StepEvent,
)
from scpdr.runtime.protected import METHODS, SCORE_CHUNK_ELEMENTS, ProtectedLM
from scpdr.runtime.runner import ModelRunner, PerModelRunner
from scpdr.runtime.sampling import SamplingParams

__all__ = [
    "METHODS",
    "SCORE_CHUNK_ELEMENTS",
    "FastPath",
    "Generation",
    "ModelRunner",
    "PerModelRunner",
    "PromptLogprobs",
    "ProtectedLM",
    "SamplingParams",
    "ScoreComponents",
    "ScoreOutput",
    "StepEvent",
]
