"""The ``naf`` object of a response choice: its tokens' certificate values as JSON carries them.

Each served token y drawn from r(·|x) has two per-token bounds (``shared/paper/scp_dr.tex``):
``k_x``, the NAF bound of Definition 2.1 under the divergence of the method's theorem (max
divergence for CP-Δ, Theorem 2.3; relative max divergence for CP-Δr, Theorem 2.7, and for SCP-Δr
on the smoothed RPDs, Algorithm 1), and ``t_x``, the LiRA bound of Theorem 4.4,
log r(y|x)/q̃(y|x) ≤ t_x for every constituent q. The choice's ``max_k_x``/``max_t_x`` are their
maxima: the worst single token, not a bound on the response (its likelihood ratio is the product
of its tokens'; the response certificate comes with the accountant, ``serve/budget.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scpdr.serve.protocol import NafCertificate

__all__ = ["build_certificate", "finite_or_none", "max_bound"]


def finite_or_none(x: float | None) -> float | None:
    """A bound as JSON can carry it: ``None`` when there is no finite bound (+inf or NaN)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def max_bound(values: Sequence[float | None]) -> float | None:
    """Max of the bounds; ``None`` if there are none or any is infinite/undefined."""
    if not values:
        return None
    out = -math.inf
    for v in values:
        if v is None:
            return None
        v = float(v)
        if not math.isfinite(v):
            return None
        out = max(out, v)
    return out


def _listed(values: Sequence[float | None] | None, show: bool) -> list[float | None] | None:
    return None if values is None or not show else [finite_or_none(v) for v in values]


def _served(
    values: Sequence[float | None], prompt_values: Sequence[float | None] | None
) -> list[float | None]:
    """Completion bounds plus the served prompt positions' (the leading null is no position)."""
    return [*values, *(prompt_values or [])[1:]]


def build_certificate(
    *,
    method: str,
    m: int | None,
    name: str,
    k_x: Sequence[float | None],
    t_x: Sequence[float | None],
    prompt_k_x: Sequence[float | None] | None = None,
    prompt_t_x: Sequence[float | None] | None = None,
    listed: slice | None = None,
    list_prompt: bool = True,
) -> NafCertificate:
    """The ``naf`` object of completion tokens ``k_x``/``t_x`` (and served prompt positions,
    whose entry 0 is ``None``: the first prompt token has no context).

    ``listed`` (streaming) lists only those tokens' values (and ``list_prompt=False`` omits the
    prompt lists) while the maxima still cover all of them: the chunks' lists concatenate to the
    full choice's, and each chunk's maxima are the running maxima.
    """
    shown = listed or slice(None)
    return NafCertificate(
        method=method,
        m=m,
        name=name,
        k_x=[finite_or_none(v) for v in k_x[shown]],
        t_x=[finite_or_none(v) for v in t_x[shown]],
        max_k_x=max_bound(_served(k_x, prompt_k_x)),
        max_t_x=max_bound(_served(t_x, prompt_t_x)),
        prompt_k_x=_listed(prompt_k_x, list_prompt),
        prompt_t_x=_listed(prompt_t_x, list_prompt),
    )
