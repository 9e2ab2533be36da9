"""scpdr.naf: every rule against a slow float64 reference, Table 1, Remark 4.1, extremes, errors."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

from scpdr import naf
from scpdr.errors import ConfigError, VocabularyMismatchError
from scpdr.naf.floor import scratch_buffer
from scpdr.naf.smoothing import top_m_indices
from scpdr.testing import correlated_logits, extreme_logits, f32_normalized_tol, f32_tol

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_METHODS = list(naf.METHODS)
CP_METHODS = [m for m in ALL_METHODS if m != "none"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


# --------------------------------------------------------------------------------------------
# slow float64 references (one row at a time, numpy)


def ref_floor(x: np.ndarray) -> np.ndarray:
    """§2.1 floor of one row: log_softmax, clamp at -20, renormalize."""
    lp = x - logsumexp(x)
    lp = np.maximum(lp, -20.0)
    return lp - logsumexp(lp)


def ref_rpd(lp: np.ndarray) -> np.ndarray:
    return lp - lp.mean()


def ref_lsm(a: np.ndarray) -> np.ndarray:
    return a - logsumexp(a)


def ref_smooth(lp: np.ndarray, lb: np.ndarray, m: int) -> tuple[np.ndarray, float]:
    """log S_m(rp, rb) of floored rows, and the relative gap between the m-th and (m+1)-th score."""
    lrp, lrb = ref_rpd(lp), ref_rpd(lb)
    score = np.exp(lp) * (lrp - lrb)
    order = np.argsort(-score, kind="stable")
    keep = order[:m]
    s = lrb.copy()
    s[keep] = lrp[keep]
    s_m, s_next = score[order[m - 1]], score[order[m]]
    gap = (s_m - s_next) / max(abs(s_m), abs(s_next), 1e-30)
    return s - s.mean(), gap


def ref_aggregate(method: str, x: np.ndarray, b: np.ndarray | None, m: int):
    """Reference for one batch row: x (K, V), b (V,). Returns (log r, min smoothing gap)."""
    lps = [ref_floor(row) for row in x]
    gap = math.inf
    if method == "none":
        return lps[0], gap
    if method == "cp-delta":
        return ref_lsm(np.min(lps, axis=0)), gap
    if method == "cp-kl":
        return ref_lsm(np.mean(lps, axis=0)), gap
    if method == "cp-delta-r":
        return ref_lsm(np.min([ref_rpd(lp) for lp in lps], axis=0)), gap
    lb = ref_floor(b)
    smoothed = []
    for lp in lps:
        s, g = ref_smooth(lp, lb, m)
        smoothed.append(s)
        gap = min(gap, g)
    if method == "scp-delta-r":
        return ref_lsm(np.min(smoothed, axis=0)), gap
    assert method == "scp-delta"
    return ref_lsm(np.min([ref_lsm(s) for s in smoothed], axis=0)), gap


def ref_batch(method: str, x: torch.Tensor, base: torch.Tensor | None, m: int):
    """Reference over all rows of x (K, *batch, V) and base (*batch, V) or (V,)."""
    xs = x.double().numpy()
    k, vocab = xs.shape[0], xs.shape[-1]
    flat = xs.reshape(k, -1, vocab)
    bs = None
    if base is not None:
        bs = np.broadcast_to(base.double().numpy(), xs.shape[1:]).reshape(-1, vocab)
    outs, gap = [], math.inf
    for i in range(flat.shape[1]):
        out, g = ref_aggregate(method, flat[:, i], None if bs is None else bs[i], m)
        outs.append(out)
        gap = min(gap, g)
    return np.stack(outs).reshape(xs.shape[1:]), gap


# --------------------------------------------------------------------------------------------
# input generation


@st.composite
def inputs(draw, *, min_k: int = 2, max_k: int = 3, max_vocab: int = 300):
    seed = draw(st.integers(0, 2**31 - 1))
    k = draw(st.integers(min_k, max_k))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    vocab = draw(st.integers(12, max_vocab))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    spikes = draw(st.integers(0, 3))
    m = draw(st.integers(1, min(12, vocab - 1)))
    x, base = correlated_logits(seed, k, batch, vocab, scale, spikes)
    return x, base, m


def assert_logprobs(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert out.dtype == torch.float32
    assert tuple(out.shape) == shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(  # normalized in float32 over V terms
        torch.logsumexp(out.double(), -1),
        torch.zeros(shape[:-1], dtype=torch.float64),
        atol=f32_normalized_tol(shape[-1], out),
        rtol=0,
    )


# --------------------------------------------------------------------------------------------
# Table 1 of the paper (Example 2.1)


def _table1():
    p = torch.tensor([0.91] + [0.01] * 9).log()
    q = torch.full((10,), 0.1).log()
    return p, q


def _rel(logp: torch.Tensor) -> torch.Tensor:
    return naf.rpd(logp).exp()


@pytest.mark.parametrize(
    ("name", "raw", "rel"),
    [
        ("p", (0.91, 0.01), (58, 0.64)),
        ("q", (0.1, 0.1), (1, 1)),
        ("cp-delta", (0.53, 0.05), (7.9, 0.79)),
        ("cp-delta-r", (0.15, 0.09), (1.5, 0.96)),
    ],
)
def test_table1_exact_values(name, raw, rel):
    p, q = _table1()
    logps = torch.stack([p, q])
    lr = {"p": naf.normalize(p), "q": naf.normalize(q)}.get(name)
    if lr is None:
        lr = naf.aggregate(name, logps)
    probs, rels = lr.exp(), _rel(lr)
    for got, want in ((probs, raw), (rels, rel)):
        # token 0 and tokens 1-9 (all equal), to the printed precision
        assert torch.allclose(got[1:], got[1].expand(9))
        for value, printed in zip((got[0], got[1]), want, strict=True):
            decimals = len(str(printed).split(".")[1]) if "." in str(printed) else 0
            assert round(float(value), decimals) == pytest.approx(printed), (name, got, want)


def test_table1_cp_delta_is_far_more_imbalanced_than_cp_delta_r():
    p, q = _table1()
    r_raw = naf.aggregate("cp-delta", torch.stack([p, q])).exp()
    r_rel = naf.aggregate("cp-delta-r", torch.stack([p, q])).exp()
    assert r_raw[0] / r_raw[1] > 5 * (r_rel[0] / r_rel[1])


# --------------------------------------------------------------------------------------------
# every rule against the reference


@SETTINGS
@given(data=inputs(), method=st.sampled_from(ALL_METHODS))
def test_methods_match_float64_reference(data, method):
    x, base, m = data
    out = naf.aggregate(method, x, base=base, m=m)
    want, gap = ref_batch(method, x, base, m)
    assume(gap > 1e-4)  # the top-m set is unambiguous in float32
    assert_logprobs(out, tuple(x.shape[1:]))
    np.testing.assert_allclose(out.double().numpy(), want, atol=5e-5, rtol=0)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_methods_match_reference_at_real_vocab_size(method):
    x, base = correlated_logits(7, 2, (2,), 49152, 3.0, spikes=3)
    out = naf.aggregate(method, x, base=base, m=10)
    want, gap = ref_batch(method, x, base, 10)
    assert gap > 1e-4
    assert_logprobs(out, (2, 49152))
    tol = f32_normalized_tol(49152, want)  # float32 sums of 49,152 terms against float64
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("constant_base", [False, True])
def test_scp_delta_r_with_a_shared_union_and_constant_base(constant_base):
    """SCP-Δr computes only the union U of kept tokens exactly: with identical constituents every
    kept token appears K times in U (with a per-row and a constant base)."""
    x, base = correlated_logits(11, 3, (2,), 2000, 3.0, spikes=2)
    x[1] = x[0]
    x[2] = x[0]
    if constant_base:
        base = base[0]
    out = naf.aggregate("scp-delta-r", x, base=base, m=10)
    want, gap = ref_batch("scp-delta-r", x, base.expand(2, 2000), 10)
    assert gap > 1e-4
    assert_logprobs(out, (2, 2000))
    np.testing.assert_allclose(out.double().numpy(), want, atol=5e-5, rtol=0)


def test_scp_delta_r_at_50k_vocab_not_divisible_by_64():
    x, base = correlated_logits(3, 3, (1,), 50000, 2.0, spikes=2)
    out = naf.aggregate("scp-delta-r", x, base=base, m=10)
    want, gap = ref_batch("scp-delta-r", x, base, 10)
    assert gap > 1e-4
    tol = f32_normalized_tol(50000, want)  # float32 sums of 50,000 terms against float64
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=0)


# Inputs the fused kernel got wrong before its normalization was fixed (issue 14): m close to V
# and large logits put almost all of the base's mass on the kept tokens, where the closed-form
# normalizer cancelled (all outputs off by 0.09 and by 2.3e-3 nats).
PINNED_M_NEAR_V = [
    (
        [[[-21, -12, -8, 11, 5, 6, 26, 25, 18, 1, -18, 20]],
         [[-7, -2, -22, -5, -17, 24, -22, -20, -1, -14, 9, -10]]],
        [[-12, 1, 19, -18, 12, 17, 25, -18, 6, -19, 22, -10]],
        11,
    ),
    (
        [[[17, -24, -15, -10, -17, 14, -21, 28, -12, 18, 1, -13, 20, -23, -16, 4]],
         [[24, -13, -18, -19, -13, -10, -7, -17, 9, 0, -20, -17, 6, 0, 21, -5]]],
        [[-24, -22, -9, -7, 3, -7, 11, -10, 22, 7, -9, 27, 8, -20, -17, 19]],
        15,
    ),
]  # fmt: skip


def pinned_m_near_v(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    x, base, m = PINNED_M_NEAR_V[i]
    return torch.tensor(x, dtype=torch.float32), torch.tensor(base, dtype=torch.float32), m


@SETTINGS
@given(data=inputs(max_k=4))
@example(data=pinned_m_near_v(0))
@example(data=pinned_m_near_v(1))
def test_scp_delta_r_fast_path_equals_cp_delta_r_of_smoothed_rpds(data):
    """SCP-Δr as served (the fused kernel where chosen, else the torch path) and its torch path
    both equal the definition: CP-Δr of the smoothed RPDs (Alg. 1), densely in float64."""
    x, base, m = data
    assume(ref_batch("scp-delta-r", x, base, m)[1] > 1e-4)  # the top-m set is unambiguous
    dense = torch.log_softmax(naf.smoothed_rpds(x, base, m).double().amin(0), -1)
    tol = f32_normalized_tol(x.shape[-1], dense)  # float32 against float64
    for fast in (naf.scp_delta_r(x, base=base, m=m), naf.scp_delta_r_torch(x, base=base, m=m)):
        np.testing.assert_allclose(fast.double().numpy(), dense.numpy(), atol=tol, rtol=0)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_aggregate_with_components_is_aggregate_plus_the_naf_distributions(method, monkeypatch):
    x, base = correlated_logits(12, 3, (2,), 4096, 3.0, spikes=2)
    log_r, comps = naf.aggregate_with_components(method, x, base=base, m=10)
    # SCP-Δr's fused CPU kernel agrees to float rounding (of a normalization over V = 4096); the
    # torch path is bit-identical (the same arithmetic)
    tol = f32_normalized_tol(4096, log_r)
    torch.testing.assert_close(log_r, naf.aggregate(method, x, base=base, m=10), atol=tol, rtol=0)
    monkeypatch.setenv("SCPDR_NAF_KERNEL", "0")
    assert torch.equal(log_r, naf.aggregate(method, x, base=base, m=10))  # bit-identical
    want = naf.smoothed_logps(x, base, 10) if method in naf.SCP_METHODS else naf.normalize(x)
    torch.testing.assert_close(comps, want, atol=0, rtol=0)


@pytest.mark.parametrize("base_shape", ["full", "vector", "one-row"])
def test_scp_delta_r_chunking_gives_the_same_rows(base_shape):
    """The torch path works through the batch in chunks (SCP_CHUNK_ELEMENTS); every row is
    computed the same way whatever the chunking, with and without the components."""
    x, base = correlated_logits(13, 2, (3, 2), 512, 3.0, spikes=2)
    base = {"full": base, "vector": base[0, 0], "one-row": base[0, :1]}[base_shape]
    whole = naf.scp_delta_r_torch(x, base=base, m=7)
    for rows in (1, 4):
        chunked = naf.scp_delta_r_torch(x, base=base, m=7, chunk_elements=rows * 2 * 512)
        torch.testing.assert_close(chunked, whole)
    want, gap = ref_batch("scp-delta-r", x, base, 7)
    assert gap > 1e-4
    np.testing.assert_allclose(whole.double().numpy(), want, atol=5e-5, rtol=0)
    # the components' path: more rows than one default chunk, against rows computed alone
    rows = naf.SCP_CHUNK_ELEMENTS // (2 * 512) + 3
    xb, bb = correlated_logits(14, 2, (rows,), 512, 3.0)
    bb = {"full": bb, "vector": bb[0], "one-row": bb[:1]}[base_shape]
    log_r, comps = naf.aggregate_with_components("scp-delta-r", xb, base=bb, m=7)
    for sl in (slice(0, 2), slice(rows - 2, rows)):
        part_b = bb if bb.ndim == 1 or bb.shape[0] == 1 else bb[sl]
        part = naf.aggregate_with_components("scp-delta-r", xb[:, sl], base=part_b, m=7)
        torch.testing.assert_close(part[0], log_r[sl])
        torch.testing.assert_close(part[1], comps[:, sl])


def test_none_returns_constituent_zero_and_accepts_k1():
    x, _ = correlated_logits(0, 2, (3,), 50, 2.0)
    out = naf.aggregate("none", x[:1])
    torch.testing.assert_close(out, naf.normalize(x[0]))
    torch.testing.assert_close(naf.aggregate("none", x), out)


def test_constant_base_vector_equals_expanded_base():
    x, base = correlated_logits(1, 2, (4,), 200, 3.0)
    vec = base[0]
    for method in ("scp-delta-r", "scp-delta"):
        a = naf.aggregate(method, x, base=vec, m=5)
        b = naf.aggregate(method, x, base=vec.expand(4, 200).clone(), m=5)
        torch.testing.assert_close(a, b)


def test_list_of_tensors_equals_stacked():
    x, base = correlated_logits(2, 3, (2,), 80, 1.0)
    for method in ALL_METHODS:
        torch.testing.assert_close(
            naf.aggregate(method, list(x), base=base, m=4),
            naf.aggregate(method, x, base=base, m=4),
        )


def test_batch_shapes_none_and_two_dims():
    x, base = correlated_logits(4, 2, (2, 3), 64, 2.0)
    full = naf.aggregate("scp-delta-r", x, base=base, m=3)
    assert full.shape == (2, 3, 64)
    one = naf.aggregate("scp-delta-r", x[:, 1, 2], base=base[1, 2], m=3)
    torch.testing.assert_close(one, full[1, 2])


# --------------------------------------------------------------------------------------------
# floor, RPD, smoothing


@SETTINGS
@given(data=inputs(min_k=1, max_k=1))
def test_normalize_floor_and_rpd_mean_zero(data):
    x, _, _ = data
    lp = naf.normalize(x[0])
    assert_logprobs(lp, tuple(x.shape[1:]))
    log_z = float(torch.logsumexp(torch.log_softmax(x[0].double(), -1).clamp_min(-20), -1).max())
    assert float(lp.min()) >= naf.LOG_FLOOR - log_z - 1e-5
    r = naf.rpd(x[0])
    assert float(r.double().mean(-1).abs().max()) < 1e-5
    torch.testing.assert_close(r, lp - lp.mean(-1, keepdim=True), atol=2e-5, rtol=0)


def test_floor_is_applied_to_tiny_probabilities():
    x = torch.tensor([0.0, -50.0, -100.0, float("-inf")])
    lp = naf.normalize(x).double()
    z = 1 + 3 * math.exp(-20)  # three tokens raised to the floor
    want = torch.tensor([0.0, -20.0, -20.0, -20.0], dtype=torch.float64) - math.log(z)
    # float32 vs exact: a few roundings (log-softmax, clamp, renormalize) of values up to 20
    torch.testing.assert_close(lp, want, atol=f32_tol(want, ops=4), rtol=0)


@SETTINGS
@given(data=inputs(min_k=1, max_k=1))
def test_smooth_matches_reference_and_is_an_rpd(data):
    x, base, m = data
    s = naf.smooth(x[0], base, m)
    flat_x = x[0].double().numpy().reshape(-1, x.shape[-1])
    flat_b = base.double().numpy().reshape(-1, x.shape[-1])
    want, gaps = [], []
    for row_x, row_b in zip(flat_x, flat_b, strict=True):
        w, g = ref_smooth(ref_floor(row_x), ref_floor(row_b), m)
        want.append(w)
        gaps.append(g)
    assume(min(gaps) > 1e-4)
    got = s.double().numpy().reshape(-1, x.shape[-1])
    np.testing.assert_allclose(got, np.stack(want), atol=5e-5, rtol=0)
    assert np.abs(got.mean(-1)).max() < 1e-5


@SETTINGS
@given(data=inputs(min_k=2, max_k=2))
def test_remark_4_1_smoothed_pairs_are_2m_sparps(data):
    """S_m(rp, rb) and S_m(rq, rb) are proportional outside a set of <= 2m tokens."""
    x, base, m = data
    s = naf.smoothed_rpds(x, base, m).double()  # (2, *batch, V)
    kept = torch.cat([naf.kept_tokens(x[0], base, m), naf.kept_tokens(x[1], base, m)], -1)
    outside = torch.ones_like(s[0], dtype=torch.bool).scatter_(-1, kept, False)
    assert int((~outside).sum(-1).max()) <= 2 * m
    diff = s[0] - s[1]  # log of the ratio: constant (log alpha) off the kept tokens
    big = torch.finfo(torch.float64).max
    hi = torch.where(outside, diff, -big).amax(-1)
    lo = torch.where(outside, diff, big).amin(-1)
    assert float((hi - lo).max()) < 1e-5


def test_smoothing_keeps_the_tokens_of_largest_score():
    # p spikes on token 3 where the base is low: token 3 has the largest score and is kept.
    base = torch.zeros(20)
    p = torch.zeros(20)
    p[3] = 6.0
    assert naf.kept_tokens(p, base, 1).tolist() == [3]
    s = naf.smooth(p, base, 1)
    lrp, lrb = naf.rpd(p), naf.rpd(base)
    beta = s[0] - lrb[0]  # log beta, the same on every smoothed token
    torch.testing.assert_close(s[3], lrp[3] + beta)
    torch.testing.assert_close(s[torch.arange(20) != 3], lrb[torch.arange(20) != 3] + beta)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 4),
    vocab=st.sampled_from([100, 640, 4096, 5000, 6400, 49152]),
    m=st.integers(1, 20),
    dup=st.booleans(),
)
def test_block_top_m_selects_the_same_set_as_topk(seed, rows, vocab, m, dup):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(rows, vocab, generator=g)
    if dup:  # many exact ties below the top
        score = score.clamp_max(0.5)
    idx = top_m_indices(score, m)
    assert idx.shape == (rows, m)
    assert all(len(set(r)) == m for r in idx.tolist())
    got = score.gather(-1, idx).sort(-1).values
    want = torch.topk(score, m, -1).values.sort(-1).values
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# extreme inputs, dtypes, no in-place modification


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_extreme_inputs_give_finite_normalized_output(method, dtype):
    x, base = extreme_logits()
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    out = naf.aggregate(method, x.to(dtype), base=base.to(dtype), m=10)
    assert_logprobs(out, (3, 4096))


def test_bf16_input_is_computed_in_float32():
    x, base = correlated_logits(9, 2, (2,), 300, 3.0)
    xb, bb = x.bfloat16(), base.bfloat16()
    for method in ALL_METHODS:
        got = naf.aggregate(method, xb, base=bb, m=5)
        want = naf.aggregate(method, xb.float(), base=bb.float(), m=5)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)


def test_inputs_are_never_modified_and_outputs_never_alias_them():
    x, base = correlated_logits(11, 2, (2,), 4096, 3.0, spikes=2)
    x_ref, base_ref = x.clone(), base.clone()
    path = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]])
    path_ref = path.clone()
    outs = [naf.aggregate(method, x, base=base, m=10) for method in ALL_METHODS]
    outs += [naf.aggregate(method, x, base=base[0], m=10) for method in naf.SCP_METHODS]
    outs += [
        naf.normalize(x),
        naf.rpd(x),
        naf.smooth(x[0], base, 10),
        naf.smoothed_rpds(x, base, 10),
        naf.smoothed_logps(x, base, 10),
        naf.kept_tokens(x[0], base, 10),
        *naf.cp_fuse_step(x, path),
    ]
    assert torch.equal(x, x_ref) and torch.equal(base, base_ref) and torch.equal(path, path_ref)
    ptrs = {x.data_ptr(), base.data_ptr(), path.data_ptr()}
    assert not any(o.data_ptr() in ptrs for o in outs)


def test_outputs_survive_later_calls_that_reuse_the_scratch_buffer():
    """Intermediates live in a cached per-thread buffer; outputs must never be views of it."""
    x1, b1 = correlated_logits(21, 2, (3,), 4096, 3.0, spikes=2)
    x2, b2 = correlated_logits(22, 2, (3,), 4096, 3.0, spikes=2)
    firsts = {m: naf.aggregate(m, x1, base=b1, m=10) for m in ALL_METHODS}
    kept = {m: t.clone() for m, t in firsts.items()}
    extra = naf.aggregate_with_components("scp-delta-r", x1, base=b1, m=10)
    extra_kept = [t.clone() for t in extra]
    for method in ALL_METHODS:  # overwrite the scratch buffer
        naf.aggregate(method, x2, base=b2, m=10)
    naf.cp_fuse_step(x2, 0.0)
    for method in ALL_METHODS:
        assert torch.equal(firsts[method], kept[method]), method
    assert all(torch.equal(a, b) for a, b in zip(extra, extra_kept, strict=True))
    scratch = scratch_buffer()
    assert scratch is not None
    lo, hi = scratch.data_ptr(), scratch.data_ptr() + scratch.numel() * 4
    for t in [*firsts.values(), *extra]:
        assert not lo <= t.data_ptr() < hi


def test_inference_mode_grad_mode_and_threads():
    x, base = correlated_logits(23, 2, (2,), 2048, 3.0, spikes=1)
    want = {m: naf.aggregate(m, x, base=base, m=10) for m in ALL_METHODS}
    with torch.inference_mode():
        for m in ALL_METHODS:  # scratch buffer used inside inference mode ...
            torch.testing.assert_close(naf.aggregate(m, x, base=base, m=10), want[m])
    for m in ALL_METHODS:  # ... and outside it again
        torch.testing.assert_close(naf.aggregate(m, x, base=base, m=10), want[m])
    xg = x.clone().requires_grad_(True)
    for m in ("cp-delta", "cp-kl", "cp-delta-r", "scp-delta-r", "scp-delta"):
        # inputs that require grad work (the rules are inference-only: no backward)
        torch.testing.assert_close(naf.aggregate(m, xg, base=base, m=10).detach(), want[m])
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        xi, bi = correlated_logits(30 + i, 2, (2,), 2048, 3.0)
        for _ in range(20):
            results[i] = naf.aggregate("scp-delta-r", xi, base=bi, m=10)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        xi, bi = correlated_logits(30 + i, 2, (2,), 2048, 3.0)
        torch.testing.assert_close(results[i], naf.aggregate("scp-delta-r", xi, base=bi, m=10))


# --------------------------------------------------------------------------------------------
# CP-Fuse


def ref_cp_fuse(lp: np.ndarray, path: np.ndarray, grid) -> tuple[np.ndarray, float]:
    """Brute force over the grid for one row: lp (2, V) floored log-probs, path (2,)."""
    objs = []
    for b1, b2 in grid:
        lr = ref_lsm(b1 * lp[0] + b2 * lp[1])
        r = np.exp(lr)
        objs.append(max(float((r * (lr - lp[i])).sum()) - path[i] for i in range(2)))
    return np.array(objs), float(min(objs))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    vocab=st.integers(5, 200),
    scale=st.sampled_from([0.3, 2.0, 8.0]),
    first_step=st.booleans(),
)
def test_cp_fuse_step_matches_brute_force(seed, batch, vocab, scale, first_step):
    x, _ = correlated_logits(seed, 2, (batch,), vocab, scale)
    g = torch.Generator().manual_seed(seed + 1)
    path = torch.zeros(2, batch) if first_step else -torch.rand(2, batch, generator=g) * 20
    log_r, w = naf.cp_fuse_step(x, 0.0 if first_step else path)
    assert_logprobs(log_r, (batch, vocab))
    assert w.shape == (batch, 2)
    grid = naf.CP_FUSE_GRID
    lps = x.double().numpy()
    for i in range(batch):
        lp = np.stack([ref_floor(lps[0, i]), ref_floor(lps[1, i])])
        objs, best = ref_cp_fuse(lp, path[:, i].double().numpy(), grid)
        chosen = grid.index(tuple(round(float(v), 1) for v in w[i]))
        assert objs[chosen] <= best + 1e-5  # optimal up to float32 ties
        want = ref_lsm(w[i, 0].item() * lp[0] + w[i, 1].item() * lp[1])
        np.testing.assert_allclose(log_r[i].double().numpy(), want, atol=5e-5, rtol=0)


def test_cp_fuse_default_grid_and_chunking():
    assert len(naf.CP_FUSE_GRID) == 120 and (0.0, 0.0) not in naf.CP_FUSE_GRID
    assert {a for a, _ in naf.CP_FUSE_GRID} == set(naf.CP_FUSE_WEIGHTS)
    x, _ = correlated_logits(3, 2, (4,), 500, 3.0)
    path = -torch.rand(2, 4) * 5
    full = naf.cp_fuse_reference(x, path)
    chunked = naf.cp_fuse_reference(x, path, chunk_elements=7 * 4 * 500)  # 7 points a chunk
    torch.testing.assert_close(full[0], chunked[0])
    torch.testing.assert_close(full[1], chunked[1])


def test_cp_fuse_path_term_favours_the_model_behind_on_the_path():
    """A constituent far less likely on the path so far gets more weight at this step."""
    x, _ = correlated_logits(8, 2, (), 100, 3.0)
    _, w0 = naf.cp_fuse_step(x, torch.tensor([0.0, -30.0]))
    _, w1 = naf.cp_fuse_step(x, torch.tensor([-30.0, 0.0]))
    assert float(w0[1] - w0[0]) > 0 and float(w1[0] - w1[1]) > 0


def test_cp_fuse_custom_grid():
    x, _ = correlated_logits(2, 2, (2,), 60, 1.0)
    log_r, w = naf.cp_fuse_step(x, 0.0, grid=[(1.0, 0.0)])
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    # the weight (1, 0) fuses exp(1·log p_1 + 0·log p_2), renormalized over V = 60: another
    # path to normalize(x[0]) (f32_normalized_tol of its log-probs)
    want = naf.normalize(x[0])
    torch.testing.assert_close(log_r, want, atol=f32_normalized_tol(60, want), rtol=0)


# --------------------------------------------------------------------------------------------
# errors


def test_unknown_method_lists_known_ones():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="known methods: none, cp-delta, cp-kl") as info:
        naf.aggregate("cp-magic", x)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ValueError, match="cp_fuse_step"):
        naf.aggregate("cp-fuse", x)


@pytest.mark.parametrize("method", CP_METHODS)
def test_k_below_two_is_rejected_for_cp_methods(method):
    with pytest.raises(ValueError, match=r"K >= 2 constituents, got K = 1"):
        naf.aggregate(method, torch.randn(1, 3, 10), base=torch.randn(3, 10), m=2)


@pytest.mark.parametrize("method", sorted(naf.SCP_METHODS))
def test_scp_errors(method):
    x = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match="pass base=Tensor"):
        naf.aggregate(method, x, m=2)
    with pytest.raises(
        VocabularyMismatchError, match="vocabulary size 11 but the constituents have 10"
    ):
        naf.aggregate(method, x, base=torch.randn(3, 11), m=2)
    with pytest.raises(ValueError, match=r"does not broadcast"):
        naf.aggregate(method, x, base=torch.randn(4, 10), m=2)
    for bad in (0, -1, 10, 11):
        with pytest.raises(ConfigError, match=r"1 <= m < V = 10"):
            naf.aggregate(method, x, base=torch.randn(3, 10), m=bad)
    for bad in (2.0, True, "3"):
        with pytest.raises(ConfigError, match="m must be an int"):
            naf.aggregate(method, x, base=torch.randn(3, 10), m=bad)


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match=r"leading constituent dimension"):
        naf.aggregate("cp-delta", torch.randn(10))
    with pytest.raises(TypeError, match="floating-point"):
        naf.aggregate("cp-delta", torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(TypeError, match="must be a Tensor"):
        naf.aggregate("cp-delta", [[0.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="differ in shape"):
        naf.aggregate("cp-delta", [torch.randn(10), torch.randn(11)])
    with pytest.raises(ValueError, match="vocabulary dimension of size >= 2"):
        naf.normalize(torch.randn(3, 1))
    with pytest.raises(ValueError, match="exactly K = 2"):
        naf.cp_fuse_step(torch.randn(3, 10), 0.0)
    with pytest.raises(ValueError, match="does not broadcast to"):
        naf.cp_fuse_step(torch.randn(2, 4, 10), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"grid must have shape \(G, 2\)"):
        naf.cp_fuse_step(torch.randn(2, 10), 0.0, grid=[(1.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match=r"no pair may be \(0, 0\)"):
        naf.cp_fuse_step(torch.randn(2, 10), 0.0, grid=[(0.0, 0.0)])


GRIDS = {
    "default": None,
    "coarse-lattice": [(0.5 * i, 0.5 * j) for i in range(5) for j in range(5) if i or j],
    # no power of the step is 1: the rows' floored masses are summed, not read off the lattice
    "lattice-without-1": [(0.3 * i, 0.3 * j) for i in range(4) for j in range(4) if i or j],
    "no-lattice": [(0.3, 0.7), (1.0, 0.0), (0.45, 1.1), (2.0, 0.15)],
}


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 2),
    vocab=st.sampled_from([5, 64, 1000, 49152]),
    scale=st.sampled_from([0.3, 2.0, 8.0]),
    first_step=st.booleans(),
    grid=st.sampled_from(sorted(GRIDS)),
)
@example(seed=27, batch=2, vocab=1000, scale=8.0, first_step=False, grid="lattice-without-1")
@example(seed=4, batch=2, vocab=49152, scale=8.0, first_step=False, grid="default")
def test_cp_fuse_statistics_choose_the_reference_weights(
    seed, batch, vocab, scale, first_step, grid
):
    """The sufficient-statistics path (the C kernel on a lattice grid) chooses the weights the
    slow reference chooses, except between grid points whose float64 objectives differ by less
    than float32 rounding, and serves the same distribution for them."""
    from scpdr import kernels

    x, _ = correlated_logits(seed, 2, (batch,), vocab, scale)
    g = torch.Generator().manual_seed(seed + 1)
    path = torch.zeros(2, batch) if first_step else -torch.rand(2, batch, generator=g) * 20
    with kernels.force("cp_fuse", "kernel"):
        log_r, w = naf.cp_fuse_step(x, path, grid=GRIDS[grid])
    ref_r, ref_w = naf.cp_fuse_reference(x, path, grid=GRIDS[grid])
    pts = naf.CP_FUSE_GRID if GRIDS[grid] is None else GRIDS[grid]
    lps = x.double().numpy()
    for i in range(batch):
        if torch.equal(w[i], ref_w[i]):
            torch.testing.assert_close(log_r[i], ref_r[i], atol=1e-5, rtol=1e-6)
            continue
        lp = np.stack([ref_floor(lps[0, i]), ref_floor(lps[1, i])])
        objs, _ = ref_cp_fuse(lp, path[:, i].double().numpy(), pts)
        pick = [min(range(len(pts)), key=lambda j, v=v: abs(pts[j][0] - v[0]) + abs(pts[j][1] - v[1]))
                for v in (w[i].tolist(), ref_w[i].tolist())]  # fmt: skip
        assert abs(objs[pick[0]] - objs[pick[1]]) <= 1e-5


def test_cp_fuse_lattice_detection():
    step, exps = naf.cp_fuse.lattice(torch.tensor(naf.CP_FUSE_GRID))
    assert step == pytest.approx(0.2) and int(exps.max()) == 10 and exps.shape == (120, 2)
    assert naf.cp_fuse.lattice(torch.tensor(GRIDS["no-lattice"])) is None
    assert naf.cp_fuse.lattice(torch.tensor([[3.0, 3.0], [1.0, 0.0]])) is None  # sum > 4
