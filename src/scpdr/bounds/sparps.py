"""Smoothing and SpaRPS bounds (paper §3 and App. A): how far smoothing moves a distribution,
and the SpaRPS estimators.

Paper numbers: Prop. 3.3 (``prop:scp_dr_bound``, ``D_r`` of m-SpaRPS pairs), Def. 3.4
(``def:exp-sparps``, Expected SpaRPS), Prop. 4.8 (``prop:scp-improved-bound``, smoothed tokens),
Lemma A.2 (``lem:smooth_kl_bound``, KL cost of smoothing).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from scpdr import naf
from scpdr.errors import ConfigError
from scpdr.naf import as_float32

__all__ = [
    "expected_sparps",
    "rare_token_ratio_bound",
    "smoothing_kl_bound",
    "sparps_dr_bound",
]


def smoothing_kl_bound(
    logp: Tensor, log_base: Tensor, m: int = naf.DEFAULT_M
) -> tuple[Tensor, Tensor]:
    """Lemma A.2: ``KL(p || p~) <= log(1 + eps) + sum_{y not in A} p(y) log(rp(y)/rb(y))``.

    ``p~`` is the distribution of ``S_m(rp, rb)``, ``A`` the m kept tokens
    (:func:`scpdr.naf.kept_tokens`) and ``eps = (tp/tb) sum_{y not in A} b(y)``. Inputs are
    floored like :func:`scpdr.naf.smooth`. Returns ``(bound, eps)``, each ``Tensor[*batch]``;
    by Pinsker ``TV(p, p~) <= sqrt(bound / 2)``.
    """
    lp = naf.normalize(logp)  # (*batch, V)
    lb = naf.normalize(log_base).expand_as(lp)  # (*batch, V)
    idx = naf.kept_tokens(logp, log_base, m)  # (*batch, m)
    outside = torch.ones_like(lp, dtype=torch.bool).scatter_(-1, idx, False)  # y not in A
    log_tp, log_tb = lp.mean(dim=-1), lb.mean(dim=-1)
    eps = torch.exp(log_tp - log_tb) * torch.where(outside, lb.exp(), 0.0).sum(dim=-1)
    d = (lp - log_tp.unsqueeze(-1)) - (lb - log_tb.unsqueeze(-1))  # log rp - log rb
    tail = torch.where(outside, lp.exp() * d, 0.0).sum(dim=-1)
    return torch.log1p(eps) + tail, eps


def sparps_dr_bound(*, m: int, n: int, log_M: float, log_alpha: float) -> float:
    """Prop. 3.3: ``D_r(p, q) <= (m/n) (log M + |log alpha|)`` for m-SpaRPS ``p`` w.r.t. ``q``.

    Args:
        m: size of the set A where p and q need not be proportional (Def. 3.2).
        n: vocabulary size.
        log_M: bound on ``|log p(y)/q(y)|`` over A.
        log_alpha: log of the proportionality constant off A.
    """
    if not (isinstance(n, int) and n >= 1 and isinstance(m, int) and 0 <= m <= n):
        raise ConfigError(f"sparps_dr_bound: need integers 0 <= m <= n, n >= 1; got m={m}, n={n}")
    if not log_M >= 0:
        raise ConfigError(f"sparps_dr_bound: log_M bounds an absolute value, so >= 0; got {log_M}")
    return (m / n) * (float(log_M) + abs(float(log_alpha)))


def rare_token_ratio_bound(*, m: int, n: int, B: float = -2.0 * naf.LOG_FLOOR) -> float:
    """Prop. 4.8: for y smoothed in both ``rq~`` and ``rp~_0``, ``rq~(y)/rp~_0(y) <= e^(2mB/n)``.

    ``B`` bounds ``|log rb - log rq|`` on kept tokens; the floor gives ``B = 40`` (the default).
    For m = 10, n = 32000 this is < 1.026.
    """
    if not (isinstance(n, int) and n >= 1 and isinstance(m, int) and 0 <= m <= n) or B < 0:
        raise ConfigError(
            f"rare_token_ratio_bound: need integers 0 <= m <= n, n >= 1 and B >= 0; got m={m}, "
            f"n={n}, B={B}"
        )
    return math.exp(2.0 * m * B / n)


def expected_sparps(log_rp_samples: Tensor, log_rq_samples: Tensor, *, m: int, C: float) -> float:
    """Def. 3.4: the smallest B for which ``(S_p, S_q)`` is (m, B, C)-Expected SpaRPS on X.

    Averages the log RPDs over the S seeds, then for each prompt x takes ``B_x`` = the smallest
    bound that holds for all but m tokens (the (m+1)-th largest ``|E log rp - E log rq|``), and
    returns the smallest B such that a fraction >= C of the prompts have ``B_x <= B``.

    Args:
        log_rp_samples: ``(S, X, V)`` log RPDs (or log-probs: each row is re-centred to mean
            0, which leaves RPDs unchanged) of S independent fine-tunes on ``S_p``.
        log_rq_samples: ``(S', X, V)`` the same for ``S_q``.
        m: tokens allowed to deviate freely (0 <= m < V).
        C: fraction of prompts that must satisfy the bound (0 < C <= 1).
    """
    a = as_float32(log_rp_samples, "expected_sparps: log_rp_samples")
    b = as_float32(log_rq_samples, "expected_sparps: log_rq_samples")
    if a.ndim != 3 or b.ndim != 3 or a.shape[1:] != b.shape[1:]:
        raise ValueError(
            "expected_sparps: samples must be (S, X, V) with the same (X, V) for p and q, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    vocab = a.shape[-1]
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < vocab:
        raise ConfigError(f"expected_sparps: m must be an int in [0, V = {vocab}), got {m!r}")
    if not 0.0 < C <= 1.0:
        raise ConfigError(f"expected_sparps: C is a fraction of prompts in (0, 1], got {C!r}")
    ea = (a - a.mean(dim=-1, keepdim=True)).mean(dim=0)  # (X, V): E[log rp]
    eb = (b - b.mean(dim=-1, keepdim=True)).mean(dim=0)  # (X, V): E[log rq]
    dev = (ea - eb).abs()  # (X, V)
    b_x = dev.kthvalue(vocab - m, dim=-1).values  # (X,): the (m+1)-th largest deviation
    n_x = b_x.shape[0]
    need = max(1, math.ceil(C * n_x - 1e-9))  # prompts that must satisfy B_x <= B
    return float(b_x.sort().values[need - 1])
