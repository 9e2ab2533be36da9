"""``scpdr serve BUNDLE``: the OpenAI-compatible server of a protected model (docs/serving.md)."""

from __future__ import annotations

from pathlib import Path

import typer


def serve(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr bundle / make_tiny_bundle)."),
    method: str | None = typer.Option(
        None,
        "--method",
        help="Aggregation rule: none, cp-delta, cp-kl, cp-delta-r, scp-delta-r, scp-delta, "
        "cp-fuse (default: the bundle's, normally scp-delta-r).",
    ),
    m: int | None = typer.Option(
        None,
        "--m",
        min=1,
        help="Smoothing parameter m of the SCP methods (default: the bundle's, normally 10).",
    ),
    base: str = typer.Option(
        "model", "--base", help="SCP base: 'model' (b variant) or 'constant' (c variant)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(
        8000, "--port", min=0, max=65535, help="TCP port (0 = any free port)."
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="SCPDR_API_KEY",
        help="Require 'Authorization: Bearer KEY' (env SCPDR_API_KEY).",
    ),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="Most sequences decoded together."),
    max_queue: int = typer.Option(
        256, "--max-queue", min=1, help="Most waiting sequences (429 above)."
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model id in the API (default: the bundle's name)."
    ),
    max_request_bytes: int = typer.Option(
        2 * 1024 * 1024, "--max-request-bytes", min=1, help="Largest request body (413 above)."
    ),
    log_level: str = typer.Option(
        "info",
        "--log-level",
        help="uvicorn log level: critical, error, warning, info, debug or trace.",
    ),
) -> None:
    """Serve BUNDLE over the OpenAI API (completions, chat, models) with NAF certificates."""
    import uvicorn
    from uvicorn.config import LOG_LEVELS

    from scpdr.commands import check_method
    from scpdr.errors import ConfigError, ScpdrError
    from scpdr.protected import ProtectedLM
    from scpdr.serve import Engine, ServeConfig, create_app

    if base not in ("model", "constant"):
        raise ConfigError(f"--base must be 'model' or 'constant', got {base!r}")
    if log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if method is not None:
        check_method(method)
    if not bundle.exists():
        raise FileNotFoundError(f"bundle directory not found: {bundle}")
    try:
        lm = ProtectedLM.from_bundle(bundle, method=method, m=m, base=base)
    except ScpdrError:
        raise
    except ValueError as exc:  # documented: a bad argument (m >= V, no base for --base model...)
        msg = str(exc).replace("base='constant'", "--base constant")
        raise ConfigError(msg.replace("base='model'", "--base model")) from None
    engine = Engine(lm, max_batch=max_batch, max_queue=max_queue)
    config = ServeConfig(
        model_name=served_model_name or bundle.resolve().name,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
    )
    app = create_app(engine, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
