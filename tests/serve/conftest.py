"""Shared fixtures of the server tests: one tiny bundle and its ProtectedLM per session, a
factory that runs a live uvicorn server on 127.0.0.1 (free port) in a background thread, and a
throwaway PostgreSQL cluster (``postgres_server``, a fresh database per test: ``pg_url``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: Constituent 0 of the test bundle is trained to prefer this text (a memorized "secret").
SECRET = "The secret code is 4417-2209."
MODEL = "tiny-bundle"


@pytest.fixture(scope="session")
def model_id() -> str:
    return MODEL


@pytest.fixture(scope="session")
def secret() -> str:
    return SECRET


@pytest.fixture(scope="session")
def serve_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scpdr.testing import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("serve") / "bundle", prefer={0: SECRET})


@pytest.fixture(scope="session")
def serve_lm(serve_bundle: Path) -> Any:
    from scpdr.runtime import ProtectedLM

    return ProtectedLM.from_bundle(serve_bundle)


@pytest.fixture(scope="session")
def start_server(serve_lm: Any) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``with start_server(max_batch=8, api_key=None, ...) as base_url:`` a live server."""
    from scpdr.serve import Engine, ServeConfig, create_app, serve_in_background

    @contextlib.contextmanager
    def start(
        *,
        max_batch: int = 8,
        max_queue: int = 256,
        batch_wait_s: float = 0.005,
        **config: Any,
    ) -> Iterator[str]:
        config.setdefault("model_name", MODEL)
        settings = ServeConfig(
            max_batch=max_batch, max_queue=max_queue, batch_wait_s=batch_wait_s, **config
        )
        app = create_app(Engine.from_config(serve_lm, settings), settings)
        with serve_in_background(app) as url:
            yield url

    return start


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ray_serve: starts a local Ray instance and Ray Serve replicas (about a minute on 2 "
        "cores); deselect with -m 'not ray_serve'",
    )


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The maintenance URL of a throwaway PostgreSQL cluster for the session: the one
    ``SCPDR_TEST_POSTGRES`` names (``.ci/run`` starts it), else one started here
    (:mod:`scpdr.testing_postgres`) and stopped at the end. Without PostgreSQL the tests that
    need it skip — except under CI (``CI`` set), where they fail."""
    from scpdr.testing_postgres import ENV_URL, PostgresUnavailableError, start_cluster

    url = os.environ.get(ENV_URL)
    if url:
        yield url
        return
    try:
        import psycopg  # noqa: F401

        cluster = start_cluster()
    except (ImportError, PostgresUnavailableError) as exc:
        message = f"no PostgreSQL could be started here: {exc}"
        if _in_ci():
            pytest.fail(f"{message} (CI is set: the PostgreSQL ledger tests must run)")
        pytest.skip(message)
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def pg_url(postgres_server: str) -> str:
    """A fresh, empty database on the session's cluster."""
    from scpdr.testing_postgres import create_database

    return create_database(postgres_server)
