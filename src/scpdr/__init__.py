"""scpdr: SCP-Δr and the NAF methods it is compared with, the bounds that certify them, and the
attacks that test them.

The paper ("Provably Protecting Fine-Tuned LLMs from Training Data Extraction while Preserving
Utility") is the source of truth for every formula; each function cites the definition/theorem
it implements.

Heavy modules (models, runtime, server) are imported lazily so that ``import scpdr`` and
``scpdr --help`` stay fast and have no side effects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Generation", "ProtectedLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.runtime import Generation, ProtectedLM, SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("ProtectedLM", "Generation", "SamplingParams"):
        from scpdr import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'scpdr' has no attribute {name!r}")
