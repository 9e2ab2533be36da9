"""One position's aggregation and certificate: the served distribution ``log r`` of a method and
its certificate ``(k_x, t_x)`` from :func:`scpdr.bounds.certify` (the one formula the runtime and
``scpdr.bounds.k_x``/``t_x`` share).

Rules (``scpdr.methods.RULES``): the stateless NAF rules of :mod:`scpdr.naf` (Defs. 2.2, 2.6,
Alg. 1) certified on the distributions their guarantee refers to (the floored constituents, or
the smoothed ``p~_i`` of SCP-Δr and SCP-Δ, §4.1), and the stateful CP-Fuse step, whose objective
adds each constituent's log-prob of the path generated so far and which is certified by the
exact max divergence to each constituent (no NAF theorem of its own).

:meth:`Aggregator.cost` is the accountant's charge of a position (:func:`scpdr.bounds.token_cost`)
from the same ``log r``, components and ``t_x``: the decoding loop and teacher-forced scoring
(echo) call it with the tokens each row reveals.
"""

from __future__ import annotations

from torch import Tensor

from scpdr import bounds, naf

__all__ = ["Aggregator"]


class Aggregator:
    """Aggregation plus certificate for one rule (and smoothing level ``m``)."""

    def __init__(self, rule: str, m: int) -> None:
        self.rule = rule
        self.m = m

    def __call__(
        self,
        logits: Tensor,
        base: Tensor | None,
        path: Tensor | None,
        *,
        bounds_too: bool = True,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """The served distribution and its certificate at N positions.

        Args:
            logits: ``(K', N, V)`` float32 logits of the constituents run.
            base: ``(N, V)`` base logits ('b'), the constant ``(V,)`` vector ('c'), or None.
            path: ``(2, N)`` CP-Fuse path log-probs (log p_i of the tokens generated so far;
                None = 0, the path-free objective).
            bounds_too: also compute the certificate (else only ``log_r``).

        Returns ``(log_r (N, V), k_x (N,), t_x (N,), comps (K', N, V))``: ``comps`` are the
        distributions the certificate refers to (None for "none", whose K' = 1 model certifies
        nothing: k_x = t_x = +inf); without ``bounds_too`` all but ``log_r`` are None.
        """
        rule = self.rule
        if not bounds_too:
            if rule == "cp-fuse":
                return naf.cp_fuse_step(logits, 0.0 if path is None else path)[0], None, None, None
            return naf.aggregate(rule, logits, base=base, m=self.m), None, None, None
        if rule == "none":
            log_r = naf.normalize(logits[0])  # (N, V)
            cert = bounds.certify(rule, log_r, log_r.unsqueeze(0))  # one model: +inf
            return log_r, cert.k_x, cert.t_x, None
        if rule == "cp-fuse":
            log_r, _ = naf.cp_fuse_step(logits, 0.0 if path is None else path)
            comps = naf.normalize(logits)  # (2, N, V)
        else:
            log_r, comps = bounds.naf_components(rule, logits, base=base, m=self.m)
        cert = bounds.certify(rule, log_r, comps)
        return log_r, cert.k_x, cert.t_x, comps

    @staticmethod
    def cost(log_r: Tensor, comps: Tensor | None, t_x: Tensor, revealed: Tensor) -> Tensor:
        """The charge of each of N positions (:func:`scpdr.bounds.token_cost`): ``(N,)`` from
        ``log_r`` ``(N, V)``, the components ``__call__`` returned (None for "none": +inf), its
        ``t_x`` ``(N,)`` and the tokens each position reveals ``(N, R)`` (-1 = none)."""
        return bounds.token_cost(log_r, comps, revealed, t_x)
