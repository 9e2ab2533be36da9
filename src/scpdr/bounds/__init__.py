"""NAF bounds and the divergences they use: pure functions of log-probability tensors (layer 1).

Numbers are those of the compiled paper (one shared counter per section for theorems,
propositions, lemmas, definitions and remarks; LaTeX labels in parentheses):

- Def. 2.1 (``def:naf``, k-NAF), Thm. 2.3 (``thm:cp_d``, CP-Δ: ``k_x = D_m``), Thm. 2.7
  (``thm:cp_dr``, CP-Δr: ``k_x = D_r``);
- Prop. 3.3 (``prop:scp_dr_bound``, D_r of m-SpaRPS pairs), Def. 3.4 (``def:exp-sparps``,
  Expected SpaRPS);
- Thm. 4.4 (``theorem:tde_q``, LiRA bound ``t_x`` for r0 = q), Thm. 4.5
  (``theorem:scp_tde_tight``, ``v_x(y)`` for r0 = CP(p0, q)), Remark 4.7 (its CP-Δ variant),
  Prop. 4.8 (``prop:scp-improved-bound``, smoothed tokens);
- Lemma A.1 (``lem:cp_d_r_util_bound``, TV(r, q) <= TV(p, q)), Lemma A.2
  (``lem:smooth_kl_bound``, KL cost of smoothing).

Modules: :mod:`~scpdr.bounds.divergences` (TV, ``D_m``, ``D_r``, max / relative max / KL
divergences), :mod:`~scpdr.bounds.certificates` (:func:`certify`, the one per-position
certificate formula the runtime and :func:`k_x`/:func:`t_x` share; :func:`v_x`),
:mod:`~scpdr.bounds.accountant` (the per-token charge ``cost_t <= t_x`` whose sum certifies a
whole response, by the chain rule and Thm. 4.4; the budget rule), :mod:`~scpdr.bounds.sparps` (smoothing cost and the SpaRPS estimators),
:mod:`~scpdr.bounds.anchor` (base-anchored serving: the largest mixture weight of the aggregate
inside a max-log-ratio ball around the base).

Conventions: the divergence functions take log-probabilities as given (``log_softmax`` is
applied, which changes normalized inputs only by rounding; no floor). The method-level bounds
(:func:`k_x`, :func:`t_x`, :func:`v_x`, :func:`smoothing_kl_bound`) take the same raw inputs as
:func:`scpdr.naf.aggregate` and floor them the same way, so that they certify exactly the
distribution ``aggregate`` returns. All results are float32; ``*batch`` shapes are kept.
"""

from __future__ import annotations

from scpdr.bounds.accountant import (
    Charge,
    charge,
    private_prefix,
    realized_log_lr,
    response_certificate,
    sequence_charges,
    token_cost,
    within_budget,
)
from scpdr.bounds.anchor import Anchored, anchor, anchor_weight
from scpdr.bounds.certificates import (
    KX_DIVERGENCE,
    V_X_METHODS,
    Certificate,
    certify,
    k_x,
    naf_components,
    t_x,
    v_x,
)
from scpdr.bounds.divergences import (
    DIVERGENCES,
    d_m,
    d_r,
    kl_divergence,
    log_typical,
    max_divergence,
    relative_max_divergence,
    tv,
)
from scpdr.bounds.sparps import (
    expected_sparps,
    rare_token_ratio_bound,
    smoothing_kl_bound,
    sparps_dr_bound,
)

__all__ = [
    "DIVERGENCES",
    "KX_DIVERGENCE",
    "V_X_METHODS",
    "Anchored",
    "Certificate",
    "Charge",
    "anchor",
    "anchor_weight",
    "certify",
    "charge",
    "d_m",
    "d_r",
    "expected_sparps",
    "k_x",
    "kl_divergence",
    "log_typical",
    "max_divergence",
    "naf_components",
    "private_prefix",
    "rare_token_ratio_bound",
    "realized_log_lr",
    "relative_max_divergence",
    "response_certificate",
    "sequence_charges",
    "smoothing_kl_bound",
    "sparps_dr_bound",
    "t_x",
    "token_cost",
    "tv",
    "v_x",
    "within_budget",
]
