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
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from scpdr import methods
from scpdr.device import DEVICE_PATTERN as _DEVICE
from scpdr.errors import ConfigError

__all__ = ["DEFAULT_MODEL_NAME", "UNPROTECTED_METHOD", "ServeConfig", "option_spec"]

logger = logging.getLogger(__name__)

#: The rule that aggregates nothing: constituent 0 alone, served only with ``unprotected``.
UNPROTECTED_METHOD = "none"

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


#: ``--precision`` values (:meth:`ServeConfig.model_dtype`).
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")
#: The ``--budget-db`` schemes of a PostgreSQL ledger (anything else is a SQLite file).
POSTGRES_SCHEMES: tuple[str, ...] = ("postgresql://", "postgres://")


def is_postgres_url(target: str | os.PathLike[str] | None) -> bool:
    """Whether ``--budget-db`` names a PostgreSQL database (else it is a SQLite file)."""
    return isinstance(target, str) and target.lower().startswith(POSTGRES_SCHEMES)


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
        None,
        "Device of the models: cpu, cuda or cuda:N (default: $SCPDR_DEVICE, else cuda when "
        "available, else cpu).",
    )
    precision: str = _f(
        "auto",
        "Weights of the models: fp32, bf16, or auto (bf16 on CUDA; on CPU bf16 where the CPU "
        "has bf16 units and a micro-benchmark at first use finds them >= 1.1x faster at batch "
        "1 and 8, else fp32; stored per CPU model). bf16 on CPU keeps a LoRA bundle's base in "
        "bf16 on the packed kernel, computing in float32: the served model is the bf16-rounded "
        "one (docs/lora_fast_path.md).",
    )
    unprotected: bool = _f(
        False,
        "Allow --method none: serve constituent 0 alone, with no protection and no certificate "
        "(its outputs can repeat its training partition); logged as a WARNING on every start.",
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
    api_key: str | None = _f(
        None,
        "Require 'Authorization: Bearer KEY' on every path but /health; several keys separated "
        "by commas are several clients (each its own --client-budget).",
    )
    max_request_bytes: int = _f(
        2 * 1024 * 1024, "Largest request body in bytes (413 above).", min=1024
    )
    max_sequences_per_request: int = _f(
        64, "Most prompts × n in one request (400 above).", min=1, option="--max-sequences"
    )
    # ---- the accountant (docs/accountant.md) ------------------------------------------------------
    budget: float | None = _f(
        None,
        "Nats each response (one choice, its echoed prompt included) may be charged; the token "
        "that would go past it is withheld (finish_reason 'budget'). Default: no limit.",
        min=0,
    )
    on_budget: str = _f(
        "stop",
        "What a response does when --budget (or the client's share) cannot serve its next "
        "position: 'stop' (finish_reason 'budget') or 'base' (continue from the base model, "
        "charged 0; needs --base model). docs/accountant.md, Proposition 3.",
    )
    anchor: float | None = _f(
        None,
        "Nats per token c: serve the mixture of the aggregate and the base model closest to "
        "the aggregate with |log q - log base| <= c at every token (needs --base model; "
        "docs/accountant.md, Proposition 4). Default: the aggregate itself.",
        min=0,
    )
    client_budget: float | None = _f(
        None,
        "Nats each API key may be charged over all its responses in --budget-window (429 "
        "past it); kept in --budget-db across restarts. Default: no limit.",
        min=0,
    )
    budget_window: float | None = _f(
        None,
        "Seconds over which --client-budget is summed (a charge stops counting this long after "
        "it was made). Default: none, the budget never refills.",
        min=0,
    )
    budget_db: str | None = _f(
        None,
        "The clients' budget ledger: a SQLite file (one host; default: "
        "$SCPDR_HOME/budgets/<model id>.sqlite) or a postgresql://USER@HOST/DB URL (replicas; "
        "needs psycopg).",
    )
    # ---- replicas (Ray Serve; docs/scaling.md) -----------------------------------------------------
    replicas: int = _f(
        1,
        "Serve from N replicas on Ray Serve (the scpdr[ray] extra) behind one HTTP endpoint; "
        "with --client-budget they need a PostgreSQL --budget-db. 1 without --address: one "
        "process, no Ray.",
        min=1,
    )
    address: str | None = _f(
        None,
        "Ray cluster to run the replicas on (e.g. auto, or HEAD:6379); default: a local Ray "
        "instance started for the server.",
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
        if self.method is not None:
            self.check_protection(self.method, warn=False)
        if self.unprotected and self.method not in (None, UNPROTECTED_METHOD):
            raise _error(
                "unprotected",
                f"applies to --method none only; --method {self.method} is protected: drop it",
            )
        if self.base not in ("model", "constant"):
            raise _error("base", f"must be 'model' or 'constant', got {self.base!r}")
        if self.precision not in PRECISIONS:
            raise _error(
                "precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.device is not None and not _DEVICE.match(self.device):
            raise _error("device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        from uvicorn.config import LOG_LEVELS

        if self.log_level.lower() not in LOG_LEVELS:
            known = ", ".join(LOG_LEVELS)
            raise _error("log_level", f"must be one of {known}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.lower())  # uvicorn's keys
        for name in ("host", "model_name", "api_key", "budget_db", "address"):
            if getattr(self, name) == "":
                raise _error(name, "must not be empty")
        if self.api_key is not None and not all(k.strip() for k in self.api_key.split(",")):
            raise _error("api_key", "has an empty key (keys are separated by commas)")
        if self.on_budget not in ("stop", "base"):
            raise _error("on_budget", f"must be 'stop' or 'base', got {self.on_budget!r}")
        if (self.on_budget == "base" or self.anchor is not None) and self.base != "model":
            what = "--on-budget base" if self.on_budget == "base" else "--anchor"
            raise _error(
                "base", f"must be 'model' with {what}: it serves the base model's distribution"
            )
        for name in ("budget", "client_budget", "budget_window", "anchor"):
            x = getattr(self, name)
            if x is not None and not math.isfinite(x):
                raise _error(name, f"must be a finite number, got {x!r}")
        if self.budget_window is not None and self.budget_window <= 0:
            raise _error("budget_window", f"must be > 0 seconds, got {self.budget_window!r}")
        if self.budget_window is not None and self.client_budget is None:
            raise _error("budget_window", "needs --client-budget (the budget it refills)")
        if self.budget_db is not None and self.client_budget is None:
            raise _error("budget_db", "needs --client-budget (the usage it keeps)")
        self._check_shared_ledger()

    def _check_shared_ledger(self) -> None:
        """Replicas (Ray) with a client budget need one ledger every replica reaches: PostgreSQL."""
        if not self.uses_ray or self.client_budget is None:
            return
        if is_postgres_url(self.budget_db):
            return
        where = f"--replicas {self.replicas}" if self.replicas > 1 else f"--address {self.address}"
        raise _error(
            "budget_db",
            f"must be a PostgreSQL URL with {where} and --client-budget: a SQLite file is one "
            "host's (replicas elsewhere would each keep their own, so a client spreading its "
            "requests over N replicas would get N times its budget); pass --budget-db "
            "postgresql://USER@HOST/DB",
        )

    @property
    def uses_ray(self) -> bool:
        """Whether the server runs on Ray Serve (``replicas`` > 1 or an ``address``)."""
        return self.replicas > 1 or self.address is not None

    def model_dtype(self, device: str = "cpu", bundle: str | os.PathLike[str] | None = None) -> Any:
        """The ``dtype`` for ``ProtectedLM.from_bundle`` on ``device``
        (:func:`scpdr.serve.precision.decode_dtype` of :attr:`precision`), measured for how
        ``bundle`` decodes with this config's method and base
        (:func:`scpdr.serve.precision.decode_form`; None: a LoRA stack)."""
        from scpdr.serve.precision import decode_dtype, decode_form

        form = None
        if bundle is not None and self.precision == "auto":
            form = decode_form(bundle, method=self.method, base=self.base)
        return decode_dtype(self.precision, device, form=form)

    def check_protection(self, method: str, *, warn: bool = True) -> None:
        """Refuse to serve ``method`` "none" (constituent 0, unprotected) unless ``unprotected``;
        with it, log a WARNING (``warn``). ``method`` is the one that will run: this config's,
        or the bundle's when the config leaves it unset."""
        if method != UNPROTECTED_METHOD:
            return
        if not self.unprotected:
            raise _error(
                "method",
                "none serves constituent 0 alone with no protection: no aggregation, no "
                "certificate, and its outputs can repeat its training partition; pass "
                "--unprotected (ServeConfig(unprotected=True)) to serve it anyway, or choose "
                "a protected method (the default, scp-delta-r)",
            )
        if warn:
            logger.warning(
                "UNPROTECTED: serving %s with method none: constituent 0 alone, no protection "
                "and no certificate; its outputs can repeat its training data (--unprotected)",
                self.served_model_name,
            )

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (``api_key`` split at commas); empty: no authentication."""
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    @property
    def served_model_name(self) -> str:
        """The model id in the API: ``model_name``, else :data:`DEFAULT_MODEL_NAME`."""
        return self.model_name or DEFAULT_MODEL_NAME


def _check_range(f: dataclasses.Field[Any], value: Any) -> None:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if value is None or (lo is None and hi is None):
        return
    number = (int, float) if "float" in str(f.type) else int
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
