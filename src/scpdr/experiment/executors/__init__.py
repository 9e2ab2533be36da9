"""How an experiment's stages run (``scpdr experiment --executor local|ray``).

- :mod:`~scpdr.experiment.executors.base`: the seam (:class:`Executor`, the picklable
  :class:`StageJob`).
- :class:`LocalExecutor` (the default): the ready stages one at a time in this process.
- :class:`~scpdr.experiment.executors.ray.RayExecutor`: every ready stage as a Ray task (an
  optional dependency, ``pip install scpdr[ray]``), with the config's ``resources:`` per kind.

Both write the same content-addressed stage cache, so a run resumes under either.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from scpdr.errors import ConfigError
from scpdr.experiment.executors.base import Advance, Executor, StageJob
from scpdr.experiment.executors.local import LocalExecutor

__all__ = ["EXECUTORS", "Advance", "Executor", "LocalExecutor", "StageJob", "make_executor"]

#: The executors ``--executor`` names.
EXECUTORS: tuple[str, ...] = ("local", "ray")


def make_executor(name: str = "local", *, address: str | None = None, **options: Any) -> Executor:
    """The executor called ``name`` (:data:`EXECUTORS`). ``address``: the Ray cluster (ray only);
    ``options``: more ``ray.init`` arguments.

    Raises:
        ConfigError: an unknown name, ``address`` without Ray, or Ray not installed.
    """
    if name == "local":
        if address is not None:
            raise ConfigError("--address names a Ray cluster; it needs --executor ray")
        return LocalExecutor()
    if name == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "--executor ray needs Ray, an optional dependency: pip install 'scpdr[ray]'"
            )
        from scpdr.experiment.executors.ray import RayExecutor

        return RayExecutor(address, **options)
    raise ConfigError(f"--executor {name!r}: must be one of {', '.join(EXECUTORS)}")
