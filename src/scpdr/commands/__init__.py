"""One module per CLI command; each exposes a plain typer command function (see ``scpdr.cli``)."""

from __future__ import annotations

from typing import Any


def format_validation_error(exc: Any) -> str:
    """A pydantic ``ValidationError`` as one line per bad field, ``field: message (got value)``,
    without pydantic's URLs and type codes."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        got = f" (got {err['input']!r})" if "input" in err and loc != "value" else ""
        parts.append(f"{loc}: {err.get('msg', '')}{got}")
    return "; ".join(parts)

