"""The ``naf`` object of a response choice: its tokens' certificate values as JSON carries them.

Each served token y drawn from r(·|x) has two per-token bounds (the paper's):
``k_x``, the NAF bound of Definition 2.1 under the divergence of the method's theorem (max
divergence for CP-Δ, Theorem 2.3; relative max divergence for CP-Δr, Theorem 2.7, and for SCP-Δr
on the smoothed RPDs, Algorithm 1), and ``t_x``, the LiRA bound of Theorem 4.4,
log r(y|x)/q̃(y|x) ≤ t_x for every constituent q. The choice's ``max_k_x``/``max_t_x`` are their
maxima: the worst single token, not a bound on the response (its likelihood ratio is the product
of its tokens').

The response's certificate is the accountant's (``docs/accountant.md``, Proposition 1): each
token's charge ``cost`` (at least the realized log-likelihood ratio of what the client sees at
that position, at most ``t_x``) and their sum ``sum_cost`` over the completion and the served
prompt positions: log r(response)/p̃_i(response) ≤ ``sum_cost`` ≤ ``sum_t_x`` for every
constituent. ``budget_left`` is the choice's budget minus ``sum_cost``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scpdr.serve.protocol import NafCertificate

__all__ = ["build_certificate", "finite_or_none", "max_bound", "total"]


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


def total(values: Sequence[float | None]) -> float | None:
    """Sum of the charges (or bounds); ``None`` if any is infinite/undefined."""
    out = []
    for v in values:
        if v is None or not math.isfinite(float(v)):
            return None
        out.append(float(v))
    return math.fsum(out)


def build_certificate(
    *,
    method: str,
    m: int | None,
    name: str,
    k_x: Sequence[float | None],
    t_x: Sequence[float | None],
    cost: Sequence[float | None] | None = None,
    prompt_k_x: Sequence[float | None] | None = None,
    prompt_t_x: Sequence[float | None] | None = None,
    prompt_cost: Sequence[float | None] | None = None,
    budget: float | None = None,
    listed: slice | None = None,
    list_prompt: bool = True,
) -> NafCertificate:
    """The ``naf`` object of completion tokens ``k_x``/``t_x``/``cost`` (and served prompt
    positions, whose entry 0 is ``None``: the first prompt token has no context), with the
    choice's ``budget`` (None: none).

    ``listed`` (streaming) lists only those tokens' values (and ``list_prompt=False`` omits the
    prompt lists) while the maxima and sums still cover all of them: the chunks' lists
    concatenate to the full choice's, and each chunk's maxima and sums are the running ones.
    """
    shown = listed or slice(None)
    cost = list(cost) if cost is not None else [None] * len(t_x)
    sum_cost = total(_served(cost, prompt_cost))
    left = None
    if budget is not None and sum_cost is not None:
        left = max(0.0, budget - sum_cost)
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
        cost=[finite_or_none(v) for v in cost[shown]],
        prompt_cost=_listed(prompt_cost, list_prompt),
        sum_cost=sum_cost,
        sum_t_x=total(_served(t_x, prompt_t_x)),
        budget_left=left,
    )
