"""``scpdr serve BUNDLE``: the OpenAI-compatible server of a protected model (docs/serving.md)."""

from __future__ import annotations

from pathlib import Path

import typer


def serve(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr bundle / make_tiny_bundle)."),
    method: str = typer.Option(
        "scp-delta-r", "--method", help="Aggregation rule: scp-delta-r, cp-delta-r, cp-delta, ..."
    ),
    m: int = typer.Option(10, "--m", help="Smoothing parameter m of the SCP methods."),
    base: str = typer.Option(
        "model", "--base", help="SCP base: 'model' (b variant) or 'constant' (c variant)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="SCPDR_API_KEY",
        help="Require 'Authorization: Bearer KEY' (env SCPDR_API_KEY).",
    ),
    max_batch: int = typer.Option(8, "--max-batch", help="Most sequences decoded together."),
    max_queue: int = typer.Option(256, "--max-queue", help="Most waiting sequences (429 above)."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model id in the API (default: the bundle's name)."
    ),
    max_request_bytes: int = typer.Option(
        2 * 1024 * 1024, "--max-request-bytes", help="Largest request body (413 above)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve BUNDLE over the OpenAI API (completions, chat, models) with NAF certificates."""
    import uvicorn

    from scpdr.errors import ConfigError
    from scpdr.protected import ProtectedLM
    from scpdr.serve import Engine, ServeConfig, create_app

    if base not in ("model", "constant"):
        raise ConfigError(f"--base must be 'model' or 'constant', got {base!r}")
    if max_batch < 1 or max_queue < 1:
        raise ConfigError("--max-batch and --max-queue must be >= 1")
    if not bundle.exists():
        raise FileNotFoundError(f"bundle directory not found: {bundle}")
    lm = ProtectedLM.from_bundle(bundle, method=method, m=m, base=base)
    engine = Engine(lm, max_batch=max_batch, max_queue=max_queue)
    config = ServeConfig(
        model_name=served_model_name or bundle.resolve().name,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
    )
    app = create_app(engine, config)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
