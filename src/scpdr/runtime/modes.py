"""Serving modes that use the base model: anchored serving and the fallback to the base.

The math is :mod:`scpdr.bounds` (:func:`~scpdr.bounds.anchor`, :func:`~scpdr.bounds.token_cost`);
this module is the glue the decoding loop (:mod:`scpdr.runtime.decoding`) and teacher-forced
scoring (:mod:`scpdr.runtime.scoring`, echo) share:

- ``anchor=c`` (:class:`~scpdr.runtime.sampling.SamplingParams`): the served distribution is
  ``q = λ r + (1 - λ) b~`` inside the max-log-ratio ball of radius c around the floored base
  ``b~``, and its certificate against the constituents (``k_x``, ``t_x``, ``cost``) is recomputed
  for q itself (:func:`anchored`);
- ``on_budget="base"``: a position is served from the private aggregate only while the budget
  covers its worst case (:meth:`Ledger.private`, decided before the draw); from the first one it
  does not, the row is served the base's distribution, charged 0 (``docs/accountant.md``,
  Propositions 3 and 4);
- each position's charge against the base (:func:`base_charge`), reported as ``anchor``.

Both modes need the base model's distribution at every position: variant 'b' only
(:func:`check_modes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from scpdr import bounds
from scpdr.runtime.sampling import SamplingParams

__all__ = ["Ledger", "anchored", "base_charge", "check_modes", "measures_base", "radii"]


def check_modes(variant: str | None, name: str, params: Sequence[SamplingParams]) -> None:
    """ValueError unless every row that anchors or falls back runs on a model with a base
    model (variant 'b'), naming the fix."""
    if variant == "b":
        return
    for p in params:
        if p.uses_base:
            what = "anchor=" if p.anchor is not None else "on_budget='base'"
            raise ValueError(
                f"{what} serves from the base model's next-token distribution, and {name} runs "
                "no base model: serve an SCP method with its base model (scp-delta-r or "
                "scp-delta with base='model', variant 'b'; `scpdr serve --base model`), or "
                "leave on_budget='stop' and anchor unset"
            )


def measures_base(variant: str | None, p: SamplingParams) -> bool:
    """Whether a row's charges against the base are computed (``anchor`` of each position):
    on a model with a base, for rows that anchor, fall back or carry any budget."""
    return variant == "b" and (p.uses_base or p.budget is not None)


def radii(params: Sequence[SamplingParams], device: torch.device) -> Tensor | None:
    """Each row's anchor radius ``c`` as ``Tensor[B]`` float64 (+inf: not anchored), or None
    when no row anchors."""
    if all(p.anchor is None for p in params):
        return None
    c = [math.inf if p.anchor is None else p.anchor for p in params]
    return torch.tensor(c, dtype=torch.float64, device=device)


def anchored(
    rule: str,
    log_r: Tensor,
    k_x: Tensor | None,
    t_x: Tensor | None,
    comps: Tensor | None,
    log_b: Tensor,
    c: Tensor,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The anchored distribution of the rows with a finite ``c`` ``(N,)`` and its certificate.

    ``log_r`` ``(N, V)``, ``k_x``/``t_x`` ``(N,)`` and ``comps`` ``(K, N, V)`` are the
    aggregator's; ``log_b`` ``(N, V)`` the floored base. Rows with ``c = +inf`` keep every value
    unchanged; the others get ``log q`` (:func:`scpdr.bounds.anchor`) and ``certify(rule, q,
    comps)``: q is not the rule's output, but the certificate formula bounds the ratio of any
    distribution (for the relative max divergence, ``max_i log(tr/tq_i) + max_i Δ_r(r||q_i) >=
    max_i max_y log r(y)/q_i(y)``, since ``log r/q_i = log(tr/tq_i) + log rr/rq_i``).
    """
    on = torch.isfinite(c)  # (N,)
    log_q = torch.where(on.unsqueeze(-1), bounds.anchor(log_r, log_b, c).log_q, log_r)
    if k_x is None or t_x is None or comps is None:
        return log_q, k_x, t_x
    cert = bounds.certify(rule, log_q, comps)
    return log_q, torch.where(on, cert.k_x, k_x), torch.where(on, cert.t_x, t_x)


def base_charge(log_s: Tensor, log_b: Tensor, revealed: Tensor) -> Tensor:
    """Each position's charge against the base: ``max(0, max_{z in R} log s(z) - log b~(z))``
    ``(N,)`` for the served ``log_s`` ``(N, V)`` and the revealed tokens ``(N, R)`` (-1 =
    none) — :func:`scpdr.bounds.token_cost` with the base as the one component and no cap.
    At most c for an anchored position, 0 for a base one."""
    inf = torch.full(log_s.shape[:-1], math.inf, device=log_s.device)
    return bounds.token_cost(log_s, log_b.unsqueeze(0), revealed, inf)


@dataclass
class Ledger:
    """One row's running sums (float64) and whether it has fallen back to the base."""

    params: SamplingParams
    spent: float = 0.0  # Σ cost: the certificate against the constituents
    spent_anchor: float = 0.0  # Σ anchor: the certificate against the base
    fallen: bool = False

    def private(self, t_x: float) -> bool:
        """Whether the next position may be served from the private aggregate, decided before
        its token is drawn on its worst cases: ``spent + t_x <= budget`` for a row that falls
        back (a row that stops keeps the stop rule, which tests the drawn token's charge), and
        ``spent_anchor + c <= anchor_budget`` for an anchor budget. False once fallen."""
        p = self.params
        if self.fallen:
            return False
        if p.on_budget == "base" and p.budget is not None and not self.spent + t_x <= p.budget:
            return False
        if p.anchor_budget is not None and p.anchor is not None:
            return self.spent_anchor + p.anchor <= p.anchor_budget
        return True

    def count(self, cost: Sequence[float], t_x: Sequence[float], anchor: Sequence[float]) -> int:
        """How many leading positions of a teacher-forced trace (echo) are served: privately
        (:meth:`private` at each, the sums updated) for a row that falls back; for a row that
        stops, also only while the stop rule serves each (``spent + cost <= budget``)."""
        p = self.params
        for n, (c, t) in enumerate(zip(cost, t_x, strict=True)):
            if not self.private(t):
                return n
            if p.on_budget == "stop" and p.budget is not None and self.spent + c > p.budget:
                return n
            self.spent += c
            if anchor:
                self.spent_anchor += anchor[n]
        return len(cost)
