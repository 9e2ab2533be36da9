"""``scpdr serve BUNDLE``: the OpenAI-compatible server of a protected model (docs/serving.md).

Each option is a field of :class:`scpdr.serve.config.ServeConfig` (its default, help and range come
from there); the command builds that config and calls :func:`scpdr.serve.server.run_server` (one
process), or :func:`scpdr.serve.replicas.run_replicas` (``--replicas N`` / ``--address``: Ray Serve).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from scpdr.serve.config import option_spec


def _option(field: str, **extra: Any) -> Any:
    decl, kwargs = option_spec(field)
    return typer.Option(kwargs.pop("default"), decl, **kwargs, **extra)


def serve(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr bundle / make_tiny_bundle)."),
    method: str | None = _option("method"),
    m: int | None = _option("m"),
    base: str = _option("base"),
    device: str | None = _option("device"),
    precision: str = _option("precision"),
    unprotected: bool = _option("unprotected"),
    host: str = _option("host"),
    port: int = _option("port"),
    api_key: str | None = _option("api_key", envvar="SCPDR_API_KEY"),
    max_batch: int = _option("max_batch"),
    max_queue: int = _option("max_queue"),
    batch_wait_s: float = _option("batch_wait_s"),
    model_name: str | None = _option("model_name"),
    max_request_bytes: int = _option("max_request_bytes"),
    max_sequences_per_request: int = _option("max_sequences_per_request"),
    budget: float | None = _option("budget"),
    on_budget: str = _option("on_budget"),
    anchor: float | None = _option("anchor"),
    client_budget: float | None = _option("client_budget"),
    budget_window: float | None = _option("budget_window"),
    budget_db: str | None = _option("budget_db", envvar="SCPDR_BUDGET_DB"),
    replicas: int = _option("replicas"),
    address: str | None = _option("address"),
    log_level: str = _option("log_level"),
) -> None:
    """Serve BUNDLE over the OpenAI API (completions, chat, models) with NAF certificates."""
    settings = dict(locals())  # every parameter but BUNDLE is the ServeConfig field it names
    del settings["bundle"]
    from scpdr.errors import ConfigError, ScpdrError
    from scpdr.serve.config import ServeConfig
    from scpdr.serve.server import run_server

    config = ServeConfig(**settings)  # ConfigError (exit 2) before anything loads
    try:
        if config.uses_ray:
            from scpdr.serve.replicas import run_replicas

            run_replicas(bundle, config)
        else:
            run_server(bundle, config)
    except ScpdrError:
        raise
    except ValueError as exc:  # documented by from_bundle: a bad argument (m >= V, no base, ...)
        msg = str(exc).replace("base='constant'", "--base constant")
        raise ConfigError(msg.replace("base='model'", "--base model")) from None
