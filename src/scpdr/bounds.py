"""NAF bounds and the divergences they use: pure functions of log-probability tensors.

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

Conventions: the divergence functions (:func:`tv`, :func:`d_m`, :func:`d_r`,
:func:`max_divergence`, ...) take log-probabilities as given (``log_softmax`` is applied, which
changes normalized inputs only by rounding; no floor). The method-level bounds (:func:`k_x`,
:func:`t_x`, :func:`v_x`, :func:`smoothing_kl_bound`) take the same raw inputs as
:func:`scpdr.naf.aggregate` and floor them the same way, so that they certify exactly the
distribution ``aggregate`` returns. All results are float32; ``*batch`` shapes are kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from scpdr import naf
from scpdr.errors import ConfigError
from scpdr.naf import _as_float32, _check_logps

__all__ = [
    "KX_DIVERGENCE",
    "V_X_METHODS",
    "d_m",
    "d_r",
    "expected_sparps",
    "k_x",
    "kl_divergence",
    "log_typical",
    "max_divergence",
    "naf_components",
    "rare_token_ratio_bound",
    "relative_max_divergence",
    "smoothing_kl_bound",
    "sparps_dr_bound",
    "t_x",
    "tv",
    "v_x",
]

#: The divergence under which each method's NAF bound ``k_x`` is stated.
KX_DIVERGENCE: dict[str, str] = {
    "none": "max",
    "cp-delta": "max",
    "scp-delta": "max",
    "cp-kl": "kl",
    "cp-delta-r": "relative-max",
    "scp-delta-r": "relative-max",
}
#: Methods with a LiRA bound ``v_x`` (Thm. 4.5 and Remark 4.7).
V_X_METHODS = ("cp-delta", "cp-delta-r", "scp-delta-r")


# --------------------------------------------------------------------------------------------
# divergences between distributions


def _lp(x: Tensor, name: str) -> Tensor:
    return torch.log_softmax(_as_float32(x, name), dim=-1)


def _check_pair(logp: Tensor, logq: Tensor, name: str) -> tuple[Tensor, Tensor]:
    if logp.shape[-1] != logq.shape[-1]:
        raise ValueError(
            f"{name}: vocabulary sizes differ ({logp.shape[-1]} vs {logq.shape[-1]}); both "
            "distributions must be over one vocabulary"
        )
    return _lp(logp, f"{name}: logp"), _lp(logq, f"{name}: logq")


def tv(logp: Tensor, logq: Tensor) -> Tensor:
    """Total variation ``TV(p, q) = 1/2 sum_y |p(y) - q(y)|`` (Thm. 2.3): ``Tensor[*batch]``."""
    lp, lq = _check_pair(logp, logq, "tv")
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(dim=-1)


def d_m(logp: Tensor, logq: Tensor) -> Tensor:
    """``D_m(p, q) = log 1/(1 - TV(p, q))`` (Thm. 2.3), ``Tensor[*batch]``.

    Computed stably as ``-logsumexp(min(log p, log q))``, since ``1 - TV = sum_y min(p, q)``.
    """
    lp, lq = _check_pair(logp, logq, "d_m")
    return -torch.logsumexp(torch.minimum(lp, lq), dim=-1)


def d_r(logp: Tensor, logq: Tensor) -> Tensor:
    """``D_r(p, q) = 1/(2n) sum_y |log rp(y) - log rq(y)|`` (Thm. 2.7): ``Tensor[*batch]``."""
    lp, lq = _check_pair(logp, logq, "d_r")
    delta = lp - lq
    return 0.5 * (delta - delta.mean(dim=-1, keepdim=True)).abs().mean(dim=-1)


def _check_r_ps(log_r: Tensor, logps: Tensor, name: str) -> tuple[Tensor, Tensor]:
    lr = _lp(log_r, f"{name}: log_r")
    lps = _lp(logps, f"{name}: logps")
    if lps.ndim < 2 or tuple(lps.shape[1:]) != tuple(lr.shape):
        raise ValueError(
            f"{name}: logps must have shape (K, *log_r.shape) = (K, {', '.join(map(str, lr.shape))}),"
            f" got {tuple(lps.shape)}"
        )
    return lr, lps


def max_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """Max divergence ``Δ(r || p_i) = max_y log r(y)/p_i(y)`` (Def. 2.1): ``Tensor[K, *batch]``.

    Args:
        log_r: ``(*batch, V)`` log-probs of the aggregate.
        logps: ``(K, *batch, V)`` log-probs of the constituents.
    """
    lr, lps = _check_r_ps(log_r, logps, "max_divergence")
    return (lr - lps).amax(dim=-1)


def relative_max_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """Relative max divergence ``Δ_r(r || p_i) = max_y log rr(y)/rp_i(y)`` (Thm. 2.7).

    Shapes as :func:`max_divergence`; returns ``Tensor[K, *batch]``. With ``δ = log r - log p``
    it is ``max(δ) - mean(δ)`` (the typical probabilities cancel into the mean).
    """
    lr, lps = _check_r_ps(log_r, logps, "relative_max_divergence")
    delta = lr - lps  # (K, *batch, V)
    return delta.amax(dim=-1) - delta.mean(dim=-1)


def kl_divergence(log_r: Tensor, logps: Tensor) -> Tensor:
    """``KL(r || p_i) = sum_y r(y) log r(y)/p_i(y)`` (CP-ΔKL's divergence): ``Tensor[K, *batch]``."""
    lr, lps = _check_r_ps(log_r, logps, "kl_divergence")
    return (lr.exp() * (lr - lps)).sum(dim=-1)


def log_typical(logp: Tensor) -> Tensor:
    """Log typical probability ``log tp = mean_y log p(y)`` (Def. 2.5): ``Tensor[*batch]``."""
    return _lp(logp, "log_typical: logp").mean(dim=-1)


_DIVERGENCES = {
    "max": max_divergence,
    "relative-max": relative_max_divergence,
    "kl": kl_divergence,
}


# --------------------------------------------------------------------------------------------
# per-method bounds


def _check_method(method: str, allowed: Sequence[str], what: str) -> None:
    if method not in allowed:
        raise ConfigError(
            f"{what}: unknown or unsupported method {method!r}; known: {', '.join(allowed)}"
        )


def naf_components(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> tuple[Tensor, Tensor]:
    """``(log r, log p_i)``: the aggregate and the K distributions its NAF guarantee refers to.

    ``log r = naf.aggregate(method, ...)`` ``(*batch, V)``; the components ``(K, *batch, V)`` are
    the floored constituents, or for the SCP methods the smoothed distributions ``p~_i``
    (:func:`scpdr.naf.smoothed_logps`, Alg. 1), from one smoothing pass
    (:func:`scpdr.naf.aggregate_with_components`).
    """
    _check_method(method, tuple(KX_DIVERGENCE), "k_x")
    return naf.aggregate_with_components(method, logps, base=base, m=m)


def k_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> Tensor:
    """The NAF bound of ``method`` at each position: ``k_x = max_i Δ(r || p_i)``, ``Tensor[*batch]``.

    Computed exactly (Def. 2.1) under the method's divergence (:data:`KX_DIVERGENCE`): max
    divergence for CP-Δ and SCP-Δ (on the smoothed ``p~_i``), relative max divergence for CP-Δr
    and SCP-Δr (on the smoothed RPDs), KL for CP-ΔKL. For K = 2 this equals ``D_m(p, q)``
    (Thm. 2.3) and ``D_r(p, q)`` (Thm. 2.7): the rules are NAF-tight. For "none" it is
    ``max_i Δ(p_0 || p_i)`` (max divergence), and ``+inf`` when K = 1 (no guarantee at all).
    """
    if method == "none":
        x = _check_logps(logps, "none", min_k=1)
        if x.shape[0] == 1:
            return torch.full(x.shape[1:-1], math.inf)
    log_r, comps = naf_components(method, logps, base=base, m=m)
    return _DIVERGENCES[KX_DIVERGENCE[method]](log_r, comps).amax(dim=0)


def t_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
    ref: int | None = None,
) -> Tensor:
    """LiRA bound for ``r_0 = q``: ``max_y log r(y)/q(y) <= t_x`` (Thm. 4.4), ``Tensor[*batch]``.

    - CP-Δr / SCP-Δr: ``t_x = log(tr / tq) + k_x`` (Thm. 4.4), with the smoothed ``q~`` for
      SCP-Δr (``log tq~ = -logsumexp(log rq~)``).
    - CP-Δ / SCP-Δ: ``t_x = k_x`` (the max divergence bounds the ratio pointwise, §2.3).
    - CP-ΔKL and "none" have no such theorem: the exact ``max_y log r(y)/q(y)`` is returned
      (``+inf`` for "none" with K = 1).

    ``ref`` is the index of the constituent playing q; ``None`` takes the max over all
    constituents, so the bound holds for every one of them.
    """
    log_r, comps = naf_components(method, logps, base=base, m=m)
    k = comps.shape[0]
    if ref is not None and not (isinstance(ref, int) and -k <= ref < k):
        raise ValueError(f"t_x: ref must be a constituent index in [0, {k}), got {ref!r}")
    sel = comps if ref is None else comps[ref].unsqueeze(0)  # (K or 1, *batch, V)
    if method == "none" and k == 1:
        return torch.full(log_r.shape[:-1], math.inf)
    if method in ("cp-delta", "scp-delta"):
        return k_x(method, logps, base=base, m=m)
    if method in ("cp-kl", "none"):
        return max_divergence(log_r, sel).amax(dim=0)
    kx = relative_max_divergence(log_r, comps).amax(dim=0)
    return (log_r.mean(dim=-1) - sel.mean(dim=-1)).amax(dim=0) + kx


def v_x(
    method: str,
    logps: Tensor | Sequence[Tensor],
    ref_logp: Tensor,
    y: Tensor | None = None,
    *,
    base: Tensor | None = None,
    m: int = naf.DEFAULT_M,
) -> Tensor:
    """LiRA bound for ``r_0 = CP(p_0, q)``: ``log r_1(y) - log r_0(y) <= v_x(y)`` (Thm. 4.5).

    ``r_i = CP(p_i, q)`` with ``logps[0] = p_1``, ``logps[1] = q`` and ``ref_logp = p_0``:

    - CP-Δr: ``v_x(y) = log max(1, rq(y)/rp_0(y)) + log(tr_1/tr_0) + k_x``, ``k_x = D_r(p_1, q)``;
    - SCP-Δr: the same on the smoothed RPDs ``rq~``, ``rp~_0`` with ``r_i = SCP-Δr(p_i, q)``;
    - CP-Δ (Remark 4.7): ``v_x(y) = log max(1, q(y)/p_0(y)) + k_x``, ``k_x = D_m(p_1, q)``.

    Args:
        logps: ``(2, *batch, V)`` logits/log-probs of ``p_1`` and ``q``.
        ref_logp: ``(*batch, V)`` logits/log-probs of ``p_0``.
        y: ``LongTensor[*batch]`` target tokens, or ``None`` for every token.
        base, m: as in :func:`scpdr.naf.aggregate` (SCP-Δr).

    Returns ``Tensor[*batch]`` at ``y``, or ``Tensor[*batch, V]`` when ``y`` is None.
    """
    _check_method(method, V_X_METHODS, "v_x")
    x1 = _check_logps(logps, method, min_k=2)
    if x1.shape[0] != 2:
        raise ValueError(f"v_x: logps must stack exactly (p_1, q), K = 2; got K = {x1.shape[0]}")
    x0 = _as_float32(ref_logp, "v_x: ref_logp")
    if tuple(x0.shape) != tuple(x1.shape[1:]):
        raise ValueError(
            f"v_x: ref_logp (p_0) must have the shape of one constituent {tuple(x1.shape[1:])}, "
            f"got {tuple(x0.shape)}"
        )
    x0q = torch.stack([x0, x1[1]])  # (2, *batch, V): p_0 and q
    log_r1, c1 = naf_components(method, x1, base=base, m=m)
    log_r0, c0 = naf_components(method, x0q, base=base, m=m)
    if method == "cp-delta":
        kx = max_divergence(log_r1, c1).amax(dim=0)  # = D_m(p_1, q)
        v = (c0[1] - c0[0]).clamp_min(0.0) + kx.unsqueeze(-1)  # (*batch, V)
    else:
        kx = relative_max_divergence(log_r1, c1).amax(dim=0)  # = D_r(p_1, q)
        lrq = c0[1] - c0[1].mean(dim=-1, keepdim=True)
        lrp0 = c0[0] - c0[0].mean(dim=-1, keepdim=True)
        log_t = log_r1.mean(dim=-1) - log_r0.mean(dim=-1)  # log tr_1 / tr_0
        v = (lrq - lrp0).clamp_min(0.0) + (log_t + kx).unsqueeze(-1)
    if y is None:
        return v
    if not isinstance(y, Tensor) or y.dtype not in (torch.int64, torch.int32):
        raise TypeError("v_x: y must be an integer LongTensor[*batch] of token ids (or None)")
    if tuple(y.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"v_x: y must have shape {tuple(v.shape[:-1])}, got {tuple(y.shape)}")
    return v.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------
# smoothing and SpaRPS


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
    a = _as_float32(log_rp_samples, "expected_sparps: log_rp_samples")
    b = _as_float32(log_rq_samples, "expected_sparps: log_rq_samples")
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
