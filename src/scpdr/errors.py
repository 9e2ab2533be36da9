"""Typed exceptions with actionable messages (STYLE.md 9, after Opacus ``validators/errors.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ScpdrError(Exception):
    """Base class of every error scpdr raises on purpose."""


class ConfigError(ScpdrError, ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


class VocabularyMismatchError(ScpdrError, ValueError):
    """Models that must share a vocabulary do not (NAF aggregation needs one token space)."""


class BundleError(ScpdrError, ValueError):
    """A bundle directory is missing, incomplete or inconsistent."""


class PartitionAuditError(ScpdrError):
    """Partitions overlap (exactly or as near-duplicates): the NAF guarantee would not hold."""


def missing_dependency(
    package: str, *, extra: str | None = None, pip: str | None = None
) -> ImportError:
    """An ImportError that says how to install ``package``."""
    cmd = pip or (f"pip install 'scpdr[{extra}]'" if extra else f"pip install {package}")
    return ImportError(f"{package} is required for this feature; install it with: {cmd}")


def format_validation_error(exc: Any, names: Mapping[str, str] | None = None) -> str:
    """A pydantic ``ValidationError`` on one line: one clause per bad field,
    ``field: message (got value)``, joined by ``"; "``, without pydantic's URLs and type codes.
    ``names`` renames a top-level field (e.g. to its CLI option). The one formatter of
    :meth:`scpdr.training.TrainConfig.from_dict` and the CLI's option checks."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        got = f" (got {err['input']!r})" if "input" in err and loc != "value" else ""
        first = str(err["loc"][0]) if err.get("loc") else ""
        where = (names or {}).get(first, loc)
        parts.append(f"{where}: {err.get('msg', '')}{got}")
    return "; ".join(parts)
