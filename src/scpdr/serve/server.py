"""Running the app: bind the port first, then load the protected model, then serve.

:func:`run_server` is what ``scpdr serve`` calls: the listening socket is bound before any model
is loaded (a port in use is a :class:`PortUnavailableError` in a second, not after minutes of
loading), and uvicorn then serves on that very socket (no window in which another process could
take the port). :func:`serve_in_background` runs an app in a thread (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from scpdr import methods
from scpdr.device import resolve_device
from scpdr.errors import ConfigError
from scpdr.serve.config import ServeConfig

__all__ = [
    "PortUnavailableError",
    "bind_socket",
    "check_bundle",
    "check_ledger",
    "load_protected",
    "resolve_device",
    "run_server",
    "serve_in_background",
]

logger = logging.getLogger(__name__)


class PortUnavailableError(ConfigError):
    """The server cannot listen on the requested host and port."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``port=0``: a free one), not yet listening.

    Raises:
        PortUnavailableError: the port is in use or not allowed; the message names both and the
            fix.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and accepted connections inherit it. Without it, a response written in two parts (head,
    # body) waits for the client's delayed ACK: ~40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            fix = (
                f"port {port} is in use: stop the process listening on it (an earlier "
                "`scpdr serve`?) or pass another --port (--port 0 picks a free one)"
            )
        elif exc.errno == errno.EACCES:
            fix = f"port {port} needs privileges here: pass --port 1024 or above"
        else:
            fix = f"check --host {host} (127.0.0.1: this machine only; 0.0.0.0: every interface)"
        raise PortUnavailableError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); {fix}"
        ) from None
    return sock


def check_bundle(bundle: str | os.PathLike[str], config: ServeConfig) -> Any:
    """``bundle``'s manifest, with the settings the server would run checked against it: the
    smoothing level m below the vocabulary size and the SCP base available (the errors name the
    option to change). Cheap: no model is loaded.

    Raises:
        BundleError: not a bundle, or a file it names is missing.
        ConfigError: the method, m or base cannot run on this bundle, or the method (the
            bundle's when the config sets none) is "none" without ``unprotected``.
    """
    from scpdr.models import read_bundle

    manifest = read_bundle(bundle)
    config.check_protection(config.method or manifest.method, warn=False)
    if (config.method or manifest.method) not in methods.SMOOTHED_RULES:
        return manifest
    m, vocab = (manifest.m if config.m is None else config.m), manifest.vocab_size
    if m >= vocab:
        where = f"--m {m}" if config.m is not None else f"the bundle's m = {m} (scpdr.json)"
        raise ConfigError(
            f"{where} must be smaller than the vocabulary size ({vocab}); the paper uses --m 10"
        )
    if config.base == "constant" and manifest.constant_base is None:
        raise ConfigError(
            f"bundle {bundle} stores no constant base vector, so --base constant is unavailable; "
            "use --base model or rebuild the bundle with held-out prompts "
            "(`scpdr bundle --held-out FILE`)"
        )
    if config.base == "model" and manifest.base is None:
        raise ConfigError(
            f"bundle {bundle} has no base model; use --base constant or rebuild it with "
            "`scpdr bundle --base REF`"
        )
    return manifest


def check_ledger(config: ServeConfig) -> None:
    """Open the config's budget ledger once and close it (nothing without ``--client-budget``):
    a database that cannot be reached stops the server before any model loads.

    Raises:
        LedgerUnreachableError: the ledger cannot be opened (a ConfigError naming the fix).
    """
    from scpdr.serve.budget import open_config_ledger

    ledger = open_config_ledger(config)
    if ledger is not None:
        ledger.close()


def load_protected(bundle: str | os.PathLike[str], config: ServeConfig, *, device: str) -> Any:
    """The :class:`~scpdr.runtime.ProtectedLM` of ``bundle`` with the config's method, m,
    base and precision, on ``device``. Raises what ``ProtectedLM.from_bundle`` raises."""
    from scpdr.runtime import ProtectedLM

    return ProtectedLM.from_bundle(
        bundle, method=config.method, m=config.m, base=config.base, device=device,
        dtype=config.model_dtype(device, bundle),
    )  # fmt: skip


def run_server(bundle: str | os.PathLike[str], config: ServeConfig) -> None:
    """Serve ``bundle`` until interrupted: check the bundle, the device and the budget ledger,
    bind the port, load the model, run uvicorn on the bound socket (the served model id defaults
    to the bundle directory's name). Every check that can fail fast runs before the model loads."""
    import uvicorn

    from scpdr.serve.app import create_app
    from scpdr.serve.engine import Engine

    if config.uses_ray:
        raise ConfigError(
            "run_server serves from one process; replicas (--replicas, --address) run on Ray "
            "Serve: call scpdr.serve.replicas.run_replicas"
        )
    if not os.path.isdir(bundle):
        raise FileNotFoundError(f"bundle directory not found: {bundle}")
    check_bundle(bundle, config)
    device = resolve_device(config.device)
    if config.model_name is None:
        name = os.path.basename(os.path.abspath(bundle))
        config = dataclasses.replace(config, model_name=name)
    check_ledger(config)
    sock = bind_socket(config.host, config.port)
    try:
        logger.info("loading %s on %s", bundle, device)
        lm = load_protected(bundle, config, device=device)
        app = create_app(Engine.from_config(lm, config), config)
        uv = uvicorn.Config(app, log_level=config.log_level, lifespan="on")
        port = sock.getsockname()[1]
        logger.info("serving %s at http://%s:%d", config.served_model_name, config.host, port)
        uvicorn.Server(uv).run(sockets=[sock])
    finally:
        sock.close()


@contextlib.contextmanager
def serve_in_background(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread; yield its base URL (``http://host:port``).

    ``port=0`` binds a free port (the socket is bound before the thread starts, so there is no
    race). The server (and, through the lifespan, the engine) stops when the block exits.
    """
    import uvicorn

    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start; see the log")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
