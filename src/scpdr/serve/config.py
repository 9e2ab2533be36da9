"""The server's one settings object (STYLE.md 6 and 17, after PEFT's ``tuners/*/config.py``).

Every option of ``scpdr serve`` is a field of :class:`ServeConfig`: the command takes each
option's default, help text and range from the field (:func:`option_spec`), and a test checks
that every field has its option. The library builds the same object: ``create_app(engine,
ServeConfig(api_key=...))``, ``Engine.from_config(lm, config)``, ``run_server(bundle, config)``.
Fields are validated at construction, before any model loads; ``dataclasses.asdict(config)``
round-trips through JSON (``ServeConfig(**d)``). A stdlib dataclass, so that ``scpdr --help``
imports neither pydantic nor FastAPI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scpdr import methods
from scpdr.device import DEVICE_PATTERN as _DEVICE
from scpdr.errors import ConfigError

__all__ = ["DEFAULT_MODEL_NAME", "ServeConfig", "option_spec"]

#: The model id served when neither ``model_name`` nor a bundle names one.
DEFAULT_MODEL_NAME = "scpdr"


def _f(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    option: str | None = None,
) -> Any:
    """A field with its help text, range and ``scpdr serve`` option (default ``--field-name``)."""
    return field(default=default, metadata={"help": help, "min": min, "max": max, "option": option})


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server: the protected model it loads, where it listens, the API's limits
    and the batching engine's. Raises :class:`~scpdr.errors.ConfigError` naming a bad field."""

    # ---- the protected model (ProtectedLM.from_bundle) ------------------------------------------
    method: str | None = _f(
        None,
        "Aggregation rule: " + ", ".join(methods.RULES) + " (default: the bundle's, normally "
        "scp-delta-r).",
    )
    m: int | None = _f(
        None,
        "Smoothing parameter m of the SCP methods (Alg. 1; default: the bundle's, normally 10).",
        min=1,
    )
    base: str = _f("model", "SCP base: 'model' (b variant) or 'constant' (c variant).")
    device: str | None = _f(
        None, "Device of the models: cpu, cuda or cuda:N (default: cuda when available, else cpu)."
    )
    # ---- where it listens -------------------------------------------------------------------------
    host: str = _f("127.0.0.1", "Interface to listen on (0.0.0.0: every interface).")
    port: int = _f(
        8000, "TCP port (0 = any free port); checked before any model loads.", min=0, max=65535
    )
    log_level: str = _f("info", "uvicorn log level: critical, error, warning, info, debug, trace.")
    # ---- the API --------------------------------------------------------------------------------
    model_name: str | None = _f(
        None,
        "Model id in the API (default: the bundle directory's name).",
        option="--served-model-name",
    )
    api_key: str | None = _f(None, "Require 'Authorization: Bearer KEY' on every path but /health.")
    max_request_bytes: int = _f(
        2 * 1024 * 1024, "Largest request body in bytes (413 above).", min=1024
    )
    max_sequences_per_request: int = _f(
        64, "Most prompts × n in one request (400 above).", min=1, option="--max-sequences"
    )
    # ---- the batching engine ----------------------------------------------------------------------
    max_batch: int = _f(8, "Most sequences decoded together.", min=1)
    max_queue: int = _f(256, "Most waiting sequences (429 above).", min=1)
    batch_wait_s: float = _f(
        0.005,
        "Seconds an idle engine waits for more sequences before a batch.",
        min=0,
        option="--batch-wait",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_range(f, getattr(self, f.name))
        if self.method is not None and self.method not in methods.RULES:
            known = ", ".join(methods.RULES)
            raise _error("method", f"{self.method!r} is unknown; use one of: {known}")
        if self.base not in ("model", "constant"):
            raise _error("base", f"must be 'model' or 'constant', got {self.base!r}")
        if self.device is not None and not _DEVICE.match(self.device):
            raise _error("device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        from uvicorn.config import LOG_LEVELS

        if self.log_level.lower() not in LOG_LEVELS:
            known = ", ".join(LOG_LEVELS)
            raise _error("log_level", f"must be one of {known}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.lower())  # uvicorn's keys
        for name in ("host", "model_name", "api_key"):
            if getattr(self, name) == "":
                raise _error(name, "must not be empty")

    @property
    def served_model_name(self) -> str:
        """The model id in the API: ``model_name``, else :data:`DEFAULT_MODEL_NAME`."""
        return self.model_name or DEFAULT_MODEL_NAME


def _check_range(f: dataclasses.Field[Any], value: Any) -> None:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if value is None or (lo is None and hi is None):
        return
    number = (int, float) if f.type == "float" else int
    if isinstance(value, bool) or not isinstance(value, number):
        raise _error(f.name, f"must be a number, got {value!r}")
    if lo is not None and value < lo:
        raise _error(f.name, f"must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise _error(f.name, f"must be <= {hi}, got {value!r}")


def _error(name: str, problem: str) -> ConfigError:
    """An error naming the option and the field: ``--max-batch must be >= 1, got 0
    (ServeConfig.max_batch)``."""
    return ConfigError(f"{option_spec(name)[0]} {problem} (ServeConfig.{name})")


def option_spec(name: str) -> tuple[str, dict[str, Any]]:
    """Field ``name``'s ``scpdr serve`` option and its ``typer.Option`` keyword arguments (the
    default, help text and range)."""
    f = {f.name: f for f in dataclasses.fields(ServeConfig)}[name]
    kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
    for key in ("min", "max"):
        if f.metadata.get(key) is not None:
            kwargs[key] = f.metadata[key]
    return f.metadata.get("option") or "--" + name.replace("_", "-"), kwargs
