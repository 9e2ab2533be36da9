"""OpenAI-compatible serving of a protected model, after vLLM's ``entrypoints/openai`` (STYLE.md
10); ``docs/serving.md`` has the endpoints and the layout:

- :mod:`~scpdr.serve.config`: :class:`ServeConfig`, every setting of ``scpdr serve``;
- :mod:`~scpdr.serve.precision`: ``--precision auto`` on CPU, bf16 base weights where measured
  faster (``resolve_decode_precision``);
- :mod:`~scpdr.serve.protocol`: pydantic request/response models; ``to_sampling_params`` (the
  runtime's :class:`~scpdr.runtime.sampling.SamplingParams`, one per sequence);
- :mod:`~scpdr.serve.engine`: :class:`Engine`, the dynamic-batching worker over ``ProtectedLM``;
- :mod:`~scpdr.serve.serving`, :mod:`~scpdr.serve.completions`, :mod:`~scpdr.serve.chat`: the
  generation endpoints (one shared flow, two wire formats);
- :mod:`~scpdr.serve.tokens`, :mod:`~scpdr.serve.certificate`: token text/bytes/log-probs and the
  ``naf`` object of each choice;
- :mod:`~scpdr.serve.errors`, :mod:`~scpdr.serve.middleware`: OpenAI-shaped errors; request ids,
  the API key and the body limit;
- :mod:`~scpdr.serve.app`: :func:`create_app` (routes); :mod:`~scpdr.serve.server`: binding the
  port, :func:`run_server`, :func:`serve_in_background`.

Importing this package imports nothing heavy: its names load on first use (PEP 562), so
``scpdr --help`` reading :mod:`~scpdr.serve.config` imports neither FastAPI nor torch (the
protocol and the engine import the runtime, hence torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scpdr.serve.app import create_app
    from scpdr.serve.config import ServeConfig
    from scpdr.serve.engine import Engine, EngineError, EngineOverloadedError, EngineStoppedError
    from scpdr.serve.errors import APIError
    from scpdr.serve.server import PortUnavailableError, run_server, serve_in_background

_HOMES = {
    "APIError": "errors",
    "Engine": "engine",
    "EngineError": "engine",
    "EngineOverloadedError": "engine",
    "EngineStoppedError": "engine",
    "PortUnavailableError": "server",
    "ServeConfig": "config",
    "create_app": "app",
    "run_server": "server",
    "serve_in_background": "server",
}

__all__ = [
    "APIError",
    "Engine",
    "EngineError",
    "EngineOverloadedError",
    "EngineStoppedError",
    "PortUnavailableError",
    "ServeConfig",
    "create_app",
    "run_server",
    "serve_in_background",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
