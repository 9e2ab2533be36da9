"""scpdr.bounds: divergences against float64 references, NAF tightness, and every theorem's
inequality checked numerically on random and constructed distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

from scpdr import bounds, methods, naf
from scpdr.errors import ConfigError
from scpdr.testing import correlated_logits

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 5e-5


@st.composite
def inputs(draw, *, k=None, max_vocab=300):
    seed = draw(st.integers(0, 2**31 - 1))
    kk = k if k is not None else draw(st.integers(2, 3))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    vocab = draw(st.integers(12, max_vocab))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    spikes = draw(st.integers(0, 3))
    m = draw(st.integers(1, min(12, vocab - 1)))
    x, base = correlated_logits(seed, kk, batch, vocab, scale, spikes)
    return x, base, m


def np64(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


# --------------------------------------------------------------------------------------------
# divergences against float64 references


@SETTINGS
@given(data=inputs(k=2))
def test_divergences_match_reference(data):
    x, _, _ = data
    lp, lq = naf.normalize(x[0]), naf.normalize(x[1])
    p, q = np.exp(np64(lp)), np.exp(np64(lq))
    a, b = np64(lp), np64(lq)
    tv_ref = 0.5 * np.abs(p - q).sum(-1)
    dm_ref = -logsumexp(np.minimum(a, b), axis=-1)
    delta = a - b
    dr_ref = 0.5 * np.abs(delta - delta.mean(-1, keepdims=True)).mean(-1)
    np.testing.assert_allclose(np64(bounds.tv(lp, lq)), tv_ref, atol=TOL)
    np.testing.assert_allclose(np64(bounds.d_m(lp, lq)), dm_ref, atol=TOL)
    np.testing.assert_allclose(np64(bounds.d_r(lp, lq)), dr_ref, atol=TOL)
    # D_m = log 1/(1 - TV) where TV is not too close to 1
    ok = tv_ref < 0.99
    np.testing.assert_allclose(np64(bounds.d_m(lp, lq))[ok], -np.log1p(-tv_ref[ok]), atol=1e-4)
    r = np64(naf.aggregate("cp-kl", x))
    kl_ref = np.stack([(np.exp(r) * (r - c)).sum(-1) for c in (a, b)])
    np.testing.assert_allclose(
        np64(bounds.kl_divergence(torch.tensor(r), torch.stack([lp, lq]))), kl_ref, atol=TOL
    )
    mx_ref = np.stack([(r - c).max(-1) for c in (a, b)])
    np.testing.assert_allclose(
        np64(bounds.max_divergence(torch.tensor(r), torch.stack([lp, lq]))), mx_ref, atol=TOL
    )
    rr = r - r.mean(-1, keepdims=True)
    rmx_ref = np.stack([(rr - (c - c.mean(-1, keepdims=True))).max(-1) for c in (a, b)])
    got = bounds.relative_max_divergence(torch.tensor(r), torch.stack([lp, lq]))
    np.testing.assert_allclose(np64(got), rmx_ref, atol=TOL)


def _whole_tensor(div: str, log_r: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """The K-component divergences over one ``(K, *batch, V)`` tensor at once (the slow,
    memory-hungry reference of the per-component loop)."""
    lr, lps = torch.log_softmax(log_r.float(), -1), torch.log_softmax(logps.float(), -1)
    d = lr - lps
    if div == "max":
        return d.amax(-1)
    if div == "relative-max":
        return d.amax(-1) - d.mean(-1)
    return (lr.exp() * d).sum(-1)


@SETTINGS
@given(
    data=inputs(),
    div=st.sampled_from(sorted(bounds.DIVERGENCES)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    holes=st.booleans(),
)
def test_divergences_one_component_at_a_time_equal_the_whole_tensor(data, div, dtype, holes):
    """The divergences hold one component's ``(*batch, V)`` temporaries at a time; their values
    are the whole-tensor formula's bit for bit (one thread), for bf16 inputs and -inf too."""
    x, _, _ = data
    log_r = x.mean(0)
    if holes:  # tokens some distributions give probability 0
        x = x.clone()
        x[0, ..., 0] = -math.inf
        log_r = log_r.clone()
        log_r[..., 1] = -math.inf
    log_r, x = log_r.to(dtype), x.to(dtype)
    got = bounds.DIVERGENCES[div](log_r, x)
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(x.shape[:-1])
    torch.testing.assert_close(got, _whole_tensor(div, log_r, x), rtol=0, atol=0, equal_nan=True)


def test_divergences_on_hand_made_distributions():
    p = torch.tensor([0.5, 0.5, 0.0 + 1e-30]).log()
    q = torch.tensor([0.25, 0.25, 0.5]).log()
    assert float(bounds.tv(p, q)) == pytest.approx(0.5, abs=1e-6)
    assert float(bounds.d_m(p, q)) == pytest.approx(math.log(2), abs=1e-6)
    assert float(bounds.d_m(p, p)) == pytest.approx(0.0, abs=1e-6)
    assert float(bounds.d_r(q, q)) == pytest.approx(0.0, abs=1e-6)
    # D_r is invariant to rescaling one distribution on all tokens (it compares RPDs)
    a = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    b = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert float(bounds.d_r(a, b)) == pytest.approx(float(bounds.d_r(a + 3.0, b)), abs=1e-6)
    assert float(bounds.log_typical(q)) == pytest.approx(math.log(0.25 * 0.25 * 0.5) / 3, abs=1e-6)


# --------------------------------------------------------------------------------------------
# NAF tightness (Theorems 2.3 and 2.7; SCP-Δr and SCP-Δ on the smoothed distributions)


@SETTINGS
@given(data=inputs(k=2))
def test_k2_rules_are_naf_tight(data):
    x, base, m = data
    lps = naf.normalize(x)
    sm = naf.smoothed_logps(x, base, m)
    cases = {
        "cp-delta": (bounds.max_divergence, lps, bounds.d_m(lps[0], lps[1])),
        "cp-delta-r": (bounds.relative_max_divergence, lps, bounds.d_r(lps[0], lps[1])),
        "scp-delta-r": (bounds.relative_max_divergence, sm, bounds.d_r(sm[0], sm[1])),
        "scp-delta": (bounds.max_divergence, sm, bounds.d_m(sm[0], sm[1])),
    }
    for method, (div, comps, closed_form) in cases.items():
        # r from the implementation k_x uses (the fused SCP-Δr kernel may break a float-rounding
        # tie among top-m scores the other way: another valid S_m, another r)
        r = naf.aggregate_with_components(method, x, base=base, m=m)[0]
        each = div(r, comps)  # (2, *batch): Δ(r || p) and Δ(r || q)
        kx = bounds.k_x(method, x, base=base, m=m)
        torch.testing.assert_close(each[0], kx, atol=TOL, rtol=0)
        torch.testing.assert_close(each[1], kx, atol=TOL, rtol=0)
        torch.testing.assert_close(kx, closed_form, atol=TOL, rtol=0)


def _ref_floor(x: np.ndarray) -> np.ndarray:
    lp = np.maximum(x - logsumexp(x, axis=-1, keepdims=True), -20.0)
    return lp - logsumexp(lp, axis=-1, keepdims=True)


def _ref_smoothed(lp: np.ndarray, lb: np.ndarray, m: int) -> tuple[np.ndarray, float]:
    """Normalized log p~ of one floored row (S_m of §4.1, float64, stable sort), and the
    relative gap between the m-th and (m+1)-th scores (0 when the top-m set is ambiguous)."""
    lrp, lrb = lp - lp.mean(), lb - lb.mean()
    score = np.exp(lp) * (lrp - lrb)
    order = np.argsort(-score, kind="stable")
    s = lrb.copy()
    s[order[:m]] = lrp[order[:m]]
    a, b = score[order[m - 1]], score[order[m]]
    return s - logsumexp(s), (a - b) / max(abs(a), abs(b), 1e-30)


def ref_pointwise_max(method, x, base, m):
    """max_i max_y of the log ratio bounded by the method's divergence, in float64 (numpy),
    and the smallest top-m gap of the smoothing (inf for unsmoothed methods)."""
    xs = np64(x)
    vocab = xs.shape[-1]
    comps = _ref_floor(xs)  # (K, *batch, V)
    gap = math.inf
    if method in naf.SCP_METHODS:
        lb = _ref_floor(np64(base.expand(x.shape[1:]))).reshape(-1, vocab)
        out = []
        for c in comps:
            rows = []
            for j, row in enumerate(c.reshape(-1, vocab)):
                sm, g = _ref_smoothed(row, lb[j], m)
                rows.append(sm)
                gap = min(gap, g)
            out.append(np.stack(rows).reshape(xs.shape[1:]))
        comps = np.stack(out)
    if method in ("cp-delta", "scp-delta"):
        r = np.min(comps, axis=0)
    else:
        r = np.min(comps - comps.mean(-1, keepdims=True), axis=0)
    r = r - logsumexp(r, axis=-1, keepdims=True)
    delta = r[None] - comps
    if method in ("cp-delta-r", "scp-delta-r"):
        delta = delta - delta.mean(-1, keepdims=True)
    return delta.max(-1).max(0), gap


@SETTINGS
@given(
    data=inputs(k=3), method=st.sampled_from(["cp-delta", "cp-delta-r", "scp-delta-r", "scp-delta"])
)
def test_k3_k_x_is_the_max_divergence_and_bounds_every_constituent(data, method):
    x, base, m = data
    kx = bounds.k_x(method, x, base=base, m=m)
    log_r, comps = bounds.naf_components(method, x, base=base, m=m)
    delta = (log_r.unsqueeze(0) - comps).double()  # (3, *batch, V)
    if method in ("cp-delta-r", "scp-delta-r"):
        delta = delta - delta.mean(-1, keepdim=True)
    # k-NAF (Def. 2.1): every constituent, every token
    assert bool((delta <= kx.double().unsqueeze(0).unsqueeze(-1) + TOL).all())
    torch.testing.assert_close(kx.double(), delta.amax(-1).amax(0), atol=TOL, rtol=0)
    want, gap = ref_pointwise_max(method, x, base, m)
    if gap < 1e-4:  # the top-m set is ambiguous in float32: the reference may keep others
        return
    np.testing.assert_allclose(np64(kx), want, atol=2e-4)


def test_k_x_cp_kl_is_max_kl_and_none():
    x, _ = correlated_logits(4, 2, (3,), 200, 3.0)
    r = naf.aggregate("cp-kl", x)
    lps = naf.normalize(x)
    torch.testing.assert_close(bounds.k_x("cp-kl", x), bounds.kl_divergence(r, lps).amax(0))
    assert torch.isinf(bounds.k_x("none", x[:1])).all() and bounds.k_x("none", x[:1]).shape == (3,)
    torch.testing.assert_close(
        bounds.k_x("none", x), bounds.max_divergence(lps[0], lps[1:]).amax(0)
    )


# --------------------------------------------------------------------------------------------
# Lemma A.1, Lemma A.2


@SETTINGS
@given(data=inputs(k=2))
def test_lemma_a1_cp_delta_r_utility_bound(data):
    x, _, _ = data
    lps = naf.normalize(x)
    r = naf.aggregate("cp-delta-r", x)
    tv_pq = bounds.tv(lps[0], lps[1])
    assert bool((bounds.tv(r, lps[1]) <= tv_pq + 1e-5).all())
    assert bool((bounds.tv(r, lps[0]) <= tv_pq + 1e-5).all())


@SETTINGS
@given(data=inputs(k=1))
def test_lemma_a2_smoothing_kl_bound(data):
    x, base, m = data
    bound, eps = bounds.smoothing_kl_bound(x[0], base, m)
    p = naf.normalize(x[0])
    pt = naf.smoothed_logps(x, base, m)[0]
    kl = (p.double().exp() * (p.double() - pt.double())).sum(-1)
    assert bool((eps >= 0).all())
    assert bool((kl <= bound.double() + 1e-5).all()), (kl, bound)
    # Pinsker's consequence
    assert bool(
        (bounds.tv(p, pt).double() <= torch.sqrt(bound.double().clamp_min(0) / 2) + 1e-5).all()
    )


def test_lemma_a2_bound_by_hand():
    # V = 4, m = 1, p = b except on token 0: nothing outside A contributes to the tail.
    b = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    p = b.clone()
    p[0] = math.log(0.7)
    bound, eps = bounds.smoothing_kl_bound(p, b, 1)
    lp, lb = naf.normalize(p).double(), naf.normalize(b).double()
    tp, tb = lp.mean().exp(), lb.mean().exp()
    want_eps = float(tp / tb * lb[1:].exp().sum())
    rp, rb = lp - lp.mean(), lb - lb.mean()
    want = math.log1p(want_eps) + float((lp[1:].exp() * (rp[1:] - rb[1:])).sum())
    assert float(eps) == pytest.approx(want_eps, abs=1e-6)
    assert float(bound) == pytest.approx(want, abs=1e-6)


# --------------------------------------------------------------------------------------------
# Prop. 3.3 (SpaRPS) and Def. 3.4 (Expected SpaRPS)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(20, 2000),
    m=st.integers(1, 10),
    log_m=st.floats(0.1, 15.0),
)
def test_prop_3_3_bound_on_constructed_sparps_pairs(seed, n, m, log_m):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64) * 2, -1)
    a = torch.randperm(n, generator=g)[:m]
    u = (torch.rand(m, generator=g, dtype=torch.float64) * 2 - 1) * log_m  # |log p/q| <= log M on A
    on_a = q[a] * u.exp()
    if float(on_a.sum()) >= 0.999:
        on_a = on_a * (0.5 / float(on_a.sum()))
        u = (on_a / q[a]).log()
    off = torch.ones(n, dtype=torch.bool)
    off[a] = False
    alpha = (1 - on_a.sum()) / q[off].sum()
    p = q * alpha
    p[a] = on_a
    assert float(p.sum()) == pytest.approx(1.0)
    lm = max(log_m, float(u.abs().max()))
    got = float(bounds.d_r(p.log(), q.log()))
    bound = bounds.sparps_dr_bound(m=m, n=n, log_M=lm, log_alpha=float(alpha.log()))
    assert got <= bound + 1e-6


def test_prop_3_3_paper_numbers():
    assert bounds.sparps_dr_bound(m=20, n=32000, log_M=20, log_alpha=-20) == pytest.approx(0.025)


def ref_expected_sparps(a, b, m, c):
    ea = (a - a.mean(-1, keepdims=True)).mean(0)
    eb = (b - b.mean(-1, keepdims=True)).mean(0)
    dev = np.abs(ea - eb)
    x = dev.shape[0]
    for cand in sorted({0.0, *dev.ravel().tolist()}):
        ok = ((dev > cand).sum(-1) <= m).sum()
        if ok >= c * x - 1e-9:
            return cand
    raise AssertionError


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    s=st.integers(1, 4),
    x=st.integers(1, 8),
    v=st.integers(2, 30),
    data=st.data(),
)
def test_expected_sparps_matches_brute_force(seed, s, x, v, data):
    m = data.draw(st.integers(0, v - 1))
    c = data.draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(s, x, v, generator=g, dtype=torch.float64)
    b = torch.randn(s, x, v, generator=g, dtype=torch.float64)
    got = bounds.expected_sparps(a.float(), b.float(), m=m, C=c)
    want = ref_expected_sparps(np64(a.float()), np64(b.float()), m, c)
    assert got == pytest.approx(want, abs=1e-5)
    if m + 1 < v:
        assert bounds.expected_sparps(a, b, m=m + 1, C=c) <= got + 1e-6  # more free tokens


def test_expected_sparps_by_hand():
    # 2 prompts, V = 4, one seed each; q's RPD is 0. Deviations: prompt 0 (3, 1, 1, 1) - 1.5 mean.
    rp = torch.tensor([[[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    rq = torch.zeros(1, 2, 4)
    # prompt 0 centred: (2.25, -0.75, -0.75, -0.75): all but 1 token within 0.75
    assert bounds.expected_sparps(rp, rq, m=1, C=1.0) == pytest.approx(0.75)
    assert bounds.expected_sparps(rp, rq, m=0, C=1.0) == pytest.approx(2.25)
    assert bounds.expected_sparps(rp, rq, m=0, C=0.5) == pytest.approx(0.0)  # prompt 1 alone


# --------------------------------------------------------------------------------------------
# Theorem 4.4 (t_x), Theorem 4.5 (v_x), Remark 4.7, Prop. 4.8


@SETTINGS
@given(
    data=inputs(), method=st.sampled_from(["cp-delta", "cp-delta-r", "scp-delta-r", "scp-delta"])
)
def test_thm_4_4_t_x_bounds_the_likelihood_ratio_to_every_constituent(data, method):
    x, base, m = data
    log_r, comps = bounds.naf_components(method, x, base=base, m=m)
    ratio = (log_r.unsqueeze(0) - comps).amax(-1)  # (K, *batch): max_y log r/q_i
    tx = bounds.t_x(method, x, base=base, m=m)
    assert bool((ratio <= tx.unsqueeze(0) + TOL).all())
    for i in range(x.shape[0]):
        ti = bounds.t_x(method, x, base=base, m=m, ref=i)
        assert bool((ratio[i] <= ti + TOL).all())
        assert bool((ti <= tx + TOL).all())
    if method in ("cp-delta-r", "scp-delta-r"):
        kx = bounds.k_x(method, x, base=base, m=m)
        log_t = (log_r.mean(-1) - comps[1].mean(-1)).double()
        torch.testing.assert_close(
            bounds.t_x(method, x, base=base, m=m, ref=1).double(), log_t + kx, atol=TOL, rtol=0
        )


def test_t_x_for_scp_uses_the_smoothed_q_typical_probability():
    x, base = correlated_logits(1, 2, (2,), 300, 3.0, spikes=2)
    s = naf.smoothed_rpds(x, base, 10)
    log_tq = -torch.logsumexp(s[1], -1)  # typical prob of q~
    torch.testing.assert_close(
        naf.smoothed_logps(x, base, 10)[1].mean(-1), log_tq, atol=1e-5, rtol=0
    )
    log_r = naf.aggregate("scp-delta-r", x, base=base, m=10)
    want = log_r.mean(-1) - log_tq + bounds.k_x("scp-delta-r", x, base=base, m=10)
    torch.testing.assert_close(
        bounds.t_x("scp-delta-r", x, base=base, m=10, ref=1), want, atol=1e-5, rtol=0
    )


def test_t_x_without_theorem_is_the_exact_ratio():
    x, _ = correlated_logits(2, 2, (3,), 100, 2.0)
    r = naf.aggregate("cp-kl", x)
    lps = naf.normalize(x)
    torch.testing.assert_close(bounds.t_x("cp-kl", x), (r - lps).amax(-1).amax(0))
    torch.testing.assert_close(bounds.t_x("cp-kl", x, ref=0), (r - lps[0]).amax(-1))
    assert torch.isinf(bounds.t_x("none", x[:1])).all()


@SETTINGS
@given(data=inputs(k=2), method=st.sampled_from(list(bounds.V_X_METHODS)))
def test_thm_4_5_v_x_bounds_log_r1_over_r0(data, method):
    x, base, m = data
    g = torch.Generator().manual_seed(int(x.abs().sum()) % 1000)
    p0 = x[1] + torch.randn(x.shape[1:], generator=g) * float(x.std())  # another fine-tune
    v = bounds.v_x(method, x, p0, base=base, m=m)
    # r1, r0 from the implementation the bounds use (SCP-Δr's fused kernel may pick another of
    # two top-m tokens whose scores tie within float rounding: another valid S_m)
    r1 = naf.aggregate_with_components(method, x, base=base, m=m)[0]
    r0 = naf.aggregate_with_components(method, torch.stack([p0, x[1]]), base=base, m=m)[0]
    assert v.shape == r1.shape
    assert bool((r1 - r0 <= v + TOL).all()), float((r1 - r0 - v).max())
    y = torch.randint(0, x.shape[-1], x.shape[1:-1], generator=g)
    torch.testing.assert_close(
        bounds.v_x(method, x, p0, y, base=base, m=m), v.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    )


def test_remark_4_7_cp_delta_variant_formula():
    x, _ = correlated_logits(6, 2, (2,), 150, 2.0)
    p0 = correlated_logits(7, 1, (2,), 150, 2.0)[0][0]
    lq, lp0 = naf.normalize(x[1]), naf.normalize(p0)
    want = (lq - lp0).clamp_min(0) + bounds.d_m(naf.normalize(x[0]), lq).unsqueeze(-1)
    torch.testing.assert_close(bounds.v_x("cp-delta", x, p0), want, atol=1e-5, rtol=0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([500, 2000, 8000]))
def test_prop_4_8_smoothed_tokens_have_small_v_x(seed, vocab):
    """Synthetic set-up of App. 'Illustration of Prop. 4.8': shared logits plus noise, p1 spiked."""
    m = 10
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, generator=g)
    p0, p1, q, b = (w + torch.randn(vocab, generator=g) for _ in range(4))
    y_s = int(torch.randint(0, vocab, (), generator=g))
    p1 = p1.clone()
    p1[y_s] += 8.0  # memorized spike
    x = torch.stack([p1, q])
    kept_q, kept_0 = naf.kept_tokens(q, b, m), naf.kept_tokens(p0, b, m)
    smoothed = torch.ones(vocab, dtype=torch.bool)
    smoothed[kept_q] = False
    smoothed[kept_0] = False
    lrb = naf.rpd(b)
    big_b = float(torch.cat([(lrb - naf.rpd(q))[kept_q], (lrb - naf.rpd(p0))[kept_0]]).abs().max())
    s = naf.smoothed_rpds(torch.stack([q, p0]), b, m)  # rq~, rp~0
    ratio = (s[0] - s[1])[smoothed]  # log rq~/rp~0 on tokens smoothed in both
    assert float(ratio.max()) <= 2 * m * big_b / vocab + 1e-5
    assert math.log(bounds.rare_token_ratio_bound(m=m, n=vocab, B=big_b)) == pytest.approx(
        2 * m * big_b / vocab
    )
    v = bounds.v_x("scp-delta-r", x, p0, base=b, m=m)
    log_t = (
        naf.aggregate("scp-delta-r", x, base=b, m=m).mean()
        - naf.aggregate("scp-delta-r", torch.stack([p0, q]), base=b, m=m).mean()
    )
    kx = bounds.k_x("scp-delta-r", x, base=b, m=m)
    lhs = v[smoothed]
    assert bool((lhs <= 2 * m * big_b / vocab + log_t + kx + 1e-5).all())


def test_prop_4_8_paper_numbers():
    assert bounds.rare_token_ratio_bound(m=10, n=32000) < 1.026
    assert bounds.rare_token_ratio_bound(m=10, n=32000) == pytest.approx(math.exp(800 / 32000))


# --------------------------------------------------------------------------------------------
# certify: the one certificate formula (k_x, t_x) of every rule


@SETTINGS
@given(data=inputs(), rule=st.sampled_from(sorted(methods.RULES)))
def test_certify_bounds_every_component_and_is_what_k_x_t_x_return(data, rule):
    """For every rule (CP-Fuse included), ``certify`` on (r, components) bounds log r/p_i at
    every token by t_x (Thm. 4.4, or the exact ratio), k_x is the rule's divergence (Def. 2.1),
    and bounds.k_x/t_x are certify over naf_components."""
    x, base, m = data
    if rule == "cp-fuse":
        x = x[:2]
        log_r = naf.cp_fuse_step(x, torch.rand(2, *x.shape[1:-1]))[0]
        comps = naf.normalize(x)
    else:
        log_r, comps = bounds.naf_components(rule, x, base=base, m=m)
    cert = bounds.certify(rule, log_r, comps)
    ratio = (log_r.unsqueeze(0) - comps).amax(-1)  # (K, *batch): max_y log r/p_i
    assert bool((ratio <= cert.t_x.unsqueeze(0) + TOL).all())
    div = "max" if rule == "cp-fuse" else methods.kx_divergence(rule)
    torch.testing.assert_close(cert.k_x, bounds.DIVERGENCES[div](log_r, comps).amax(0))
    for i in range(comps.shape[0]):
        ti = bounds.certify(rule, log_r, comps, ref=i).t_x
        assert bool((ratio[i] <= ti + TOL).all()) and bool((ti <= cert.t_x + TOL).all())
    if rule != "cp-fuse":
        torch.testing.assert_close(bounds.k_x(rule, x, base=base, m=m), cert.k_x)
        torch.testing.assert_close(bounds.t_x(rule, x, base=base, m=m), cert.t_x)
        torch.testing.assert_close(
            bounds.t_x(rule, x, base=base, m=m, ref=1),
            bounds.certify(rule, log_r, comps, ref=1).t_x,
        )
    one = bounds.certify("none", comps[0], comps[:1])  # a single model: no guarantee
    assert torch.isinf(one.k_x).all() and torch.isinf(one.t_x).all()


# --------------------------------------------------------------------------------------------
# errors


def test_bound_errors():
    x = torch.randn(2, 3, 10)
    with pytest.raises(ConfigError, match="known: none, cp-delta"):
        bounds.k_x("cp-magic", x)
    with pytest.raises(ConfigError, match="v_x: unknown or unsupported method 'cp-kl'"):
        bounds.v_x("cp-kl", x, x[0])
    with pytest.raises(ValueError, match="exactly"):
        bounds.v_x("cp-delta-r", torch.randn(3, 3, 10), x[0])
    with pytest.raises(ValueError, match="ref_logp"):
        bounds.v_x("cp-delta-r", x, torch.randn(4, 10))
    with pytest.raises(TypeError, match="token ids"):
        bounds.v_x("cp-delta-r", x, x[0], torch.zeros(3))
    with pytest.raises(ValueError, match="y must have shape"):
        bounds.v_x("cp-delta-r", x, x[0], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="ref must be a constituent index"):
        bounds.t_x("cp-delta-r", x, ref=2)
    with pytest.raises(ConfigError, match="no NAF bound for rule 'cp-magic'"):
        bounds.certify("cp-magic", x[0], x)
    with pytest.raises(ValueError, match="vocabulary sizes differ"):
        bounds.tv(torch.randn(10), torch.randn(11))
    with pytest.raises(ValueError, match=r"logps must have shape \(K"):
        bounds.max_divergence(torch.randn(3, 10), torch.randn(2, 4, 10))
    with pytest.raises(ConfigError, match="0 <= m <= n"):
        bounds.sparps_dr_bound(m=5, n=4, log_M=1.0, log_alpha=0.0)
    with pytest.raises(ConfigError, match="log_M"):
        bounds.sparps_dr_bound(m=1, n=4, log_M=-1.0, log_alpha=0.0)
    with pytest.raises(ConfigError, match="rare_token_ratio_bound"):
        bounds.rare_token_ratio_bound(m=1, n=4, B=-1.0)
    with pytest.raises(ValueError, match=r"\(S, X, V\)"):
        bounds.expected_sparps(torch.randn(2, 3), torch.randn(2, 3), m=1, C=0.5)
    with pytest.raises(ConfigError, match=r"m must be an int in \[0, V = 4\)"):
        bounds.expected_sparps(torch.randn(1, 2, 4), torch.randn(1, 2, 4), m=4, C=0.5)
    with pytest.raises(ConfigError, match=r"C is a fraction"):
        bounds.expected_sparps(torch.randn(1, 2, 4), torch.randn(1, 2, 4), m=1, C=0.0)
    with pytest.raises(ValueError, match="pass base=Tensor"):
        bounds.k_x("scp-delta-r", x)
