"""``scpdr serve D --replicas N``: the same app in N replicas on Ray Serve, one ledger for all.

Each replica is a Ray Serve deployment replica (a Ray actor) that loads the bundle and serves
:func:`scpdr.serve.app.create_app` — the one app definition of the single-process server, its
routes, middleware and ``naf`` fields unchanged — through Ray Serve's ASGI ingress
(``@serve.ingress`` with ``__serve_build_asgi_app__``: the app is built inside the replica, after
its model loaded). Ray Serve's HTTP proxy listens on ``--host``/``--port`` and spreads requests
over the replicas; Ray restarts a replica that dies (``check_health``: its engine stopped).

Every replica opens the same ledger (``--budget-db``): with ``--client-budget`` it must be
PostgreSQL (:class:`~scpdr.serve.config.ServeConfig` refuses a SQLite file), so that a client
spreading its requests over the replicas is held to one budget
(:mod:`scpdr.serve.ledger.postgres`). Without ``--address`` a local Ray instance is started for
the server (and stopped with it); with one, the replicas run on that cluster, which keeps
running. ``docs/scaling.md`` has the cluster recipe and the failure modes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import threading
from typing import Any

from scpdr.errors import ConfigError
from scpdr.serve.config import ServeConfig
from scpdr.serve.server import bind_socket, check_bundle, check_ledger, load_protected

__all__ = ["APP_NAME", "deployment", "run_replicas", "start_replicas", "stop_replicas"]

logger = logging.getLogger(__name__)

#: The Ray Serve application name of the server.
APP_NAME = "scpdr"


def _import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise ConfigError(
            f"--replicas and --address run on Ray Serve, which is not installed ({exc}); "
            "pip install 'scpdr[ray]'"
        ) from None
    return serve


def deployment() -> Any:
    """The Ray Serve deployment class of one replica (``.bind(bundle, settings)``, ``settings``
    being ``dataclasses.asdict`` of its :class:`ServeConfig`)."""
    serve = _import_serve()

    @serve.deployment(name=APP_NAME)
    @serve.ingress()
    class ScpdrReplica:
        """One replica: the bundle's ProtectedLM, its engine and :func:`create_app`."""

        def __init__(self, bundle: str, settings: dict[str, Any]) -> None:
            self.bundle = bundle
            self.config = ServeConfig(**settings)
            self.engine: Any = None

        def __serve_build_asgi_app__(self) -> Any:
            from scpdr.device import resolve_device
            from scpdr.serve.app import create_app
            from scpdr.serve.engine import Engine

            device = resolve_device(self.config.device)
            lm = load_protected(self.bundle, self.config, device=device)
            self.engine = Engine.from_config(lm, self.config)
            return create_app(self.engine, self.config)

        def check_health(self) -> None:
            if self.engine is not None and not self.engine.alive:
                raise RuntimeError("the replica's engine stopped")

    return ScpdrReplica


def _gpus_per_replica(config: ServeConfig, cluster_gpus: float) -> int:
    """1 when the replicas run on CUDA (``--device cuda``, or no ``--device`` on a cluster with
    GPUs), else 0. ``cuda:N`` is refused: Ray gives each replica its own GPU."""
    device = config.device
    if device is not None and re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(
            f"--device {device} pins one GPU, but Ray gives each replica its own: pass "
            "--device cuda"
        )
    if device == "cuda":
        return 1
    return 1 if device is None and cluster_gpus > 0 else 0


def start_replicas(bundle: str | os.PathLike[str], config: ServeConfig) -> str:
    """Check the bundle and the ledger, start Ray (local without ``config.address``) and Ray
    Serve's proxy on ``config.host``/``config.port`` (0: a free port), deploy
    ``config.replicas`` replicas of ``bundle`` and wait until every one serves. Returns the base
    URL (``http://host:port``).

    Raises:
        ConfigError: a bad bundle or setting, an unreachable ledger, a busy port, no Ray Serve.
        RuntimeError: the replicas failed to start (Ray's message, with the replica's error).
    """
    if not os.path.isdir(bundle):
        raise FileNotFoundError(f"bundle directory not found: {bundle}")
    bundle = os.path.abspath(bundle)
    check_bundle(bundle, config)
    if config.model_name is None:
        config = dataclasses.replace(config, model_name=os.path.basename(bundle))
    check_ledger(config)
    with bind_socket(config.host, config.port) as probe:  # a busy port fails here, in a second
        port = probe.getsockname()[1]
    serve = _import_serve()
    import ray

    if not ray.is_initialized():
        if config.address is not None:
            ray.init(address=config.address, log_to_driver=False)
        else:
            cpus = max(os.cpu_count() or 1, config.replicas)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    gpus = _gpus_per_replica(config, float(ray.cluster_resources().get("GPU", 0)))
    options = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
    serve.start(http_options={"host": config.host, "port": port})
    app = deployment().options(
        num_replicas=config.replicas,
        ray_actor_options=options,
        max_ongoing_requests=config.max_queue,
    )
    settings = dataclasses.asdict(config)
    logger.info("starting %d replica(s) of %s on Ray Serve", config.replicas, bundle)
    serve.run(app.bind(bundle, settings), name=APP_NAME, route_prefix="/")
    url = f"http://{config.host}:{port}"
    logger.info("serving %s at %s (%d replicas)", config.served_model_name, url, config.replicas)
    return url


def stop_replicas(*, shutdown_ray: bool) -> None:
    """Delete the replicas and stop Ray Serve (and Ray itself when ``shutdown_ray``)."""
    serve = _import_serve()
    import ray

    if ray.is_initialized():
        serve.shutdown()
        if shutdown_ray:
            ray.shutdown()


def run_replicas(bundle: str | os.PathLike[str], config: ServeConfig) -> None:
    """Serve ``bundle`` from ``config.replicas`` replicas until SIGINT or SIGTERM, then stop
    them (and the local Ray instance; a cluster named by ``--address`` keeps running)."""
    import ray

    started_ray = not ray.is_initialized() and config.address is None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_replicas(bundle, config)
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop_replicas(shutdown_ray=started_ray)
