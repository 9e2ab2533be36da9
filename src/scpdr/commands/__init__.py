"""One module per CLI command; each exposes a plain typer command function (see ``scpdr.cli``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_m", "check_method", "check_out_dir", "split_list"]


def check_method(method: str, option: str = "--method") -> None:
    """``method`` must name an aggregation rule (:data:`scpdr.methods.RULES`): a typo fails here,
    before any model loads."""
    from scpdr.errors import ConfigError
    from scpdr.methods import RULES

    if method not in RULES:
        raise ConfigError(f"{option} {method!r} is unknown; use one of: {', '.join(RULES)}")


def check_m(m: int | None, vocab_size: int) -> None:
    """``--m`` (tokens kept unsmoothed) must be below the bundle's vocabulary size."""
    from scpdr.errors import ConfigError

    if m is not None and m >= vocab_size:
        raise ConfigError(
            f"--m {m} must be smaller than the bundle's vocabulary size ({vocab_size}); "
            "the paper uses m = 10"
        )


def check_out_dir(out: Path, option: str = "--out") -> None:
    """``out`` must be a directory or not exist yet: checked before the work, not after it."""
    from scpdr.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option} {out} is a file; pass a directory (created if missing)")


def split_list(value: str, option: str, known: str) -> list[str]:
    """A comma-separated option value as a non-empty list (an empty one would do nothing)."""
    from scpdr.errors import ConfigError

    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{option} is empty; pass a comma-separated list of {known}")
    return items
