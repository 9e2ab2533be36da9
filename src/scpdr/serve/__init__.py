"""OpenAI-compatible serving of a protected model, in three parts (STYLE.md 10, after vLLM
``entrypoints/openai``): :mod:`~scpdr.serve.protocol` (pydantic request/response models),
:mod:`~scpdr.serve.engine` (the dynamic-batching scheduler over ``ProtectedLM``) and
:mod:`~scpdr.serve.app` (FastAPI routes, errors, auth, limits). See ``docs/serving.md``.

Importing this package imports FastAPI but no model code; torch is imported by the engine's
worker thread when it starts.
"""

from __future__ import annotations

from scpdr.serve.app import APIError, ServeConfig, create_app, serve_in_background
from scpdr.serve.engine import (
    Engine,
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    SamplingParams,
)

__all__ = [
    "APIError",
    "Engine",
    "EngineError",
    "EngineOverloadedError",
    "EngineStoppedError",
    "SamplingParams",
    "ServeConfig",
    "create_app",
    "serve_in_background",
]
