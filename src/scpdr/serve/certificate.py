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

Against the base model (``docs/accountant.md``, Propositions 3 and 4): ``anchor`` is each token's
charge against the (floored) base, at most c under ``--anchor c``, and ``sum_anchor`` the
response's certificate against it; with ``--on-budget base``, ``fallback_at`` is the first token
served from the base (charged 0) and ``private_tokens`` how many came from the aggregate.
:class:`NafCertificate` is the wire shape (re-exported by :mod:`scpdr.serve.protocol`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["NafCertificate", "build_certificate", "finite_or_none", "max_bound", "total"]


class NafCertificate(BaseModel):
    """The NAF certificate of one choice (the ``naf`` extension object).

    ``k_x[i]`` is the bound of Definition 2.1 for the distribution the i-th completion token was
    drawn from, under the divergence of the method's theorem (Theorem 2.3: max-divergence for
    CP-Δ; Theorem 2.7: relative max-divergence for CP-Δr, and for SCP-Δr on the smoothed RPDs,
    Algorithm 1). ``t_x[i]`` is the LiRA bound of Theorem 4.4, log r(y|x)/q̃(y|x) ≤ t_x for every
    constituent. ``null`` means there is no finite bound (e.g. method "none" on one model).
    With ``echo`` and logprobs, ``prompt_k_x``/``prompt_t_x`` certify the served prompt positions
    too (entry 0 is null, like ``token_logprobs``), and the maxima cover them.

    The accountant (``docs/accountant.md``): ``cost[i]`` is the i-th token's charge, at least the
    realized log-likelihood ratio of everything the client sees at that position against every
    constituent and at most ``t_x[i]``; ``sum_cost`` (tokens and served prompt positions) is the
    **certificate of the response**: its log-likelihood ratio against every constituent is at
    most ``sum_cost`` (chain rule), and ``sum_t_x`` is the worst case. ``budget_left`` is what
    the choice's budget still allows (null without one). ``anchor``/``sum_anchor`` are the same
    charge and certificate against the base model; ``fallback_at``/``private_tokens`` say where a
    response that ran out of budget continued from the base (``--on-budget base``;
    ``docs/accountant.md``, Propositions 3 and 4).
    """

    model_config = ConfigDict(extra="forbid")

    method: str = Field(description="Aggregation rule (scpdr.methods.RULES).")
    m: int | None = Field(description="Smoothing parameter m of SCP methods, else null.")
    name: str = Field(description="Result-row name of the variant (scpdr.methods.SPECS).")
    k_x: list[float | None] = Field(description="Per completion token NAF bound.")
    t_x: list[float | None] = Field(description="Per completion token LiRA bound (Thm 4.4).")
    max_k_x: float | None = Field(description="Max of k_x (and prompt_k_x); null if none/infinite.")
    max_t_x: float | None = Field(
        description="Max per-token t_x (and prompt_t_x): the worst single token, not a bound "
        "on the response (sum_cost is); null if none/infinite."
    )
    cost: list[float | None] = Field(
        default_factory=list, description="Per completion token charge (<= t_x)."
    )
    sum_cost: float | None = Field(
        None,
        description="The response's certificate: Σ cost over its tokens and served prompt "
        "positions; null if infinite (no certificate).",
    )
    sum_t_x: float | None = Field(None, description="Σ t_x over the same positions (worst case).")
    budget_left: float | None = Field(
        None, description="Nats the choice's budget still allows; null without a budget."
    )
    prompt_k_x: list[float | None] | None = Field(
        None, description="With echo + logprobs: k_x at each served prompt position."
    )
    prompt_t_x: list[float | None] | None = Field(
        None, description="With echo + logprobs: t_x at each served prompt position."
    )
    prompt_cost: list[float | None] | None = Field(
        None, description="With echo + logprobs: the charge of each served prompt position."
    )
    anchor: list[float | None] | None = Field(
        None,
        description="Per completion token charge against the base model (<= c with --anchor c; "
        "0 for a token served from the base); null when not measured (no --anchor, no "
        "--on-budget base and no budget, or no base model).",
    )
    sum_anchor: float | None = Field(
        None,
        description="The response's certificate against the base: Σ anchor over its tokens and "
        "served prompt positions; null when not measured.",
    )
    prompt_anchor: list[float | None] | None = Field(
        None, description="With echo + logprobs: each prompt position's charge against the base."
    )
    fallback_at: int | None = Field(
        None,
        description="--on-budget base: index of the first completion token served from the base "
        "model (0 when the echoed prompt already fell back); null when every token was private.",
    )
    private_tokens: int | None = Field(
        None,
        description="--on-budget base: completion tokens served from the private aggregate "
        "(null when the server does not fall back).",
    )


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
    anchor: Sequence[float | None] | None = None,
    prompt_anchor: Sequence[float | None] | None = None,
    fallback_at: int | None = None,
    private_tokens: int | None = None,
) -> NafCertificate:
    """The ``naf`` object of completion tokens ``k_x``/``t_x``/``cost`` (and served prompt
    positions, whose entry 0 is ``None``: the first prompt token has no context), with the
    choice's ``budget`` (None: none); ``anchor``/``prompt_anchor`` the charges against the base
    (None: not measured), ``fallback_at``/``private_tokens`` the fallback (None: none).

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
        anchor=None if anchor is None else [finite_or_none(v) for v in list(anchor)[shown]],
        sum_anchor=None if anchor is None else total(_served(anchor, prompt_anchor)),
        prompt_anchor=None if anchor is None else _listed(prompt_anchor, list_prompt),
        fallback_at=fallback_at,
        private_tokens=private_tokens,
    )
