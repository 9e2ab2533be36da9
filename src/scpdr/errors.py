"""Typed exceptions with actionable messages (STYLE.md 9, after Opacus ``validators/errors.py``)."""

from __future__ import annotations


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
