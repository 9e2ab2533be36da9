"""Serving from the base: the fallback (``on_budget="base"``) and base-anchored serving
(``anchor=c``) as theorems (``docs/accountant.md``, Propositions 3 and 4).

- the anchor (``scpdr.bounds.anchor``): ``|log q(y) - log b(y)| <= c`` at every token, λ the
  largest weight that keeps it (against a float64 bisection), for hard logits (-inf, extreme,
  bf16); the charges of the anchored distribution are its realized log-ratios, against every
  smoothed constituent and against the base;
- the fallback rule (``scpdr.bounds.private_prefix``) against the runtime's ledger;
- acceptance: every budgeted response of a tiny bundle (stop, fallback, anchored, anchored and
  falling back, echoed; greedy and sampled, several seeds) is recomputed from the raw
  constituents and base models, and its realized log-likelihood ratio against every p~_i and
  against the base is at most the reported sums (``sum_cost``, ``sum_anchor``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scpdr import bounds, models, naf
from scpdr.runtime import Generation, ProtectedLM, SamplingParams
from scpdr.runtime.modes import Ledger, base_charge
from scpdr.testing import correlated_logits, f32_tol

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: One position's charge computed by two forward paths (KV-cached vs one teacher-forced forward)
#: differs by float32 rounding only: at most 64 ulps of 20 (tests/test_budget.py's count).
FORWARD_TOL = f32_tol(-naf.LOG_FLOOR, ops=64)
PROMPTS = ["My secret code is", "Hello there, how are", "x"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


# ------------------------------------------------------------------------------------------------
# the anchor, one position


def _logits(kind: str, seed: int, rows: int, vocab: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    if kind == "-inf":
        x[torch.rand(rows, vocab, generator=g) < 0.3] = -math.inf
        x[:, 0] = 0.0  # every row keeps some mass
    elif kind == "extreme":
        x = x * 1e3
    elif kind == "bf16":
        x = x.to(torch.bfloat16)
    return x


def _log_mix64(lr: torch.Tensor, lb: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The exact mixture ``log(λ r + (1 - λ) b)`` in float64 (log space: no underflow)."""
    w = lam.double().unsqueeze(-1)
    return torch.logaddexp(w.log() + lr.double(), torch.log1p(-w) + lb.double())


def _radius64(lr: torch.Tensor, lb: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``max_y |log q_λ(y) - log b(y)|`` in float64 (tokens neither q nor b gives mass: 0)."""
    mix = _log_mix64(lr, lb, lam)
    d = mix - lb.double()
    d = d.masked_fill(torch.isneginf(mix) & torch.isneginf(lb), 0.0).nan_to_num(nan=math.inf)
    return d.abs().amax(-1)


def _bisect(lr: torch.Tensor, lb: torch.Tensor, c: float, iters: int = 80) -> torch.Tensor:
    """The largest λ in [0, 1] inside the ball, by bisection in float64 (PMixED's method): the
    independent reference of the closed form."""
    lo = torch.zeros(lr.shape[:-1], dtype=torch.float64)
    hi = torch.ones_like(lo)
    ok1 = _radius64(lr, lb, hi) <= c
    for _ in range(iters):
        mid = (lo + hi) / 2
        ok = _radius64(lr, lb, mid) <= c
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return torch.where(ok1, torch.ones_like(lo), lo)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["normal", "-inf", "extreme", "bf16"]),
    vocab=st.integers(2, 300),
    scale=st.sampled_from([0.01, 1.0, 5.0, 20.0]),
    c=st.sampled_from([1e-3, 0.05, 0.5, 2.0, 10.0]),
)
@example(seed=0, kind="-inf", vocab=2, scale=20.0, c=1e-3)
@example(seed=1, kind="extreme", vocab=300, scale=20.0, c=10.0)
def test_anchor_is_inside_the_ball_and_its_weight_is_the_largest(seed, kind, vocab, scale, c):
    x_r = _logits(kind, seed, 4, vocab, scale)
    x_b = _logits(kind, seed + 1, 4, vocab, scale / 2)
    before = (x_r.clone(), x_b.clone())
    out = bounds.anchor(x_r, x_b, c)
    assert torch.equal(x_r, before[0]) and torch.equal(x_b, before[1])  # inputs untouched
    lr = torch.log_softmax(x_r.float(), -1)
    lb = torch.log_softmax(x_b.float(), -1)
    lq = out.log_q
    assert lq.dtype == torch.float32 and lq.shape == lr.shape
    finite = torch.isfinite(lb)
    assert torch.isfinite(lq[finite]).all() and torch.isneginf(lq[~finite]).all()
    # the ball, for every token: up to the float32 rounding of log b(y) ± c
    tol = f32_tol(lb[finite].abs().max(), c, ops=2)
    assert ((lq - lb)[finite].abs() <= c + tol).all()
    # a distribution (its mass 1 up to float32 rounding of V terms)
    assert torch.logsumexp(lq.double(), -1).abs().max() < 1e-5
    # λ: inside the ball in exact arithmetic, and the largest such weight (bisection reference)
    lam = out.weight
    assert ((lam >= 0) & (lam <= 1)).all()
    assert (_radius64(lr, lb, lam) <= c + 1e-9).all()
    ref = _bisect(lr, lb, c)
    assert torch.allclose(lam, ref, rtol=1e-6, atol=1e-12), (lam, ref)
    bumped = (lam * (1 + 1e-6) + 1e-12).clamp_max(1.0)
    inside = lam < 1 - 1e-9
    assert (_radius64(lr, lb, bumped)[inside] > c).all()  # no larger weight fits
    # λ = 1 rows are r itself; λ = 0 rows the base itself
    one = lam == 1
    assert torch.equal(lq[one], lr[one])
    zero = lam == 0
    assert torch.allclose(lq[zero], lb[zero], atol=1e-6) or not zero.any()


def test_anchor_edge_cases_and_errors():
    lr = torch.log_softmax(torch.tensor([[3.0, 0.0, -2.0, 1.0]]), -1)
    lb = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), -1)
    # c = +inf is no anchor at all; c = 0 is the base itself (unless r is the base)
    assert torch.equal(bounds.anchor(lr, lb, math.inf).log_q, lr)
    assert bounds.anchor_weight(lr, lb, 0.0).item() == 0.0
    torch.testing.assert_close(bounds.anchor(lr, lb, 0.0).log_q, lb)
    assert bounds.anchor_weight(lb, lb, 0.0).item() == 1.0  # r inside every ball
    # one radius per row
    two_r, two_b = lr.expand(2, 4), lb.expand(2, 4)
    w = bounds.anchor_weight(two_r, two_b, torch.tensor([0.1, math.inf]))
    assert w[1] == 1.0 and 0 < w[0] < 1
    # a token the base gives nothing and r some: only the base fits
    lb0 = lb.clone()
    lb0[0, 0] = -math.inf
    assert bounds.anchor_weight(lr, lb0, 5.0).item() == 0.0
    with pytest.raises(ValueError, match="c must be >= 0"):
        bounds.anchor(lr, lb, -0.1)
    with pytest.raises(ValueError, match="shape of log_r"):
        bounds.anchor(lr, lb[:, :3], 1.0)


# ------------------------------------------------------------------------------------------------
# the charges of an anchored sequence: both sums are the realized log-likelihood ratios


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    rule=st.sampled_from(["scp-delta-r", "scp-delta"]),
    k=st.integers(2, 3),
    vocab=st.integers(12, 200),
    scale=st.sampled_from([0.1, 1.0, 4.0, 12.0]),
    c=st.sampled_from([0.01, 0.1, 1.0, 5.0]),
    top=st.integers(0, 3),
)
def test_anchored_charges_are_the_realized_log_ratios(seed, rule, k, vocab, scale, c, top):
    t = 8  # positions of one sequence
    x, base = correlated_logits(seed, k, (t,), vocab, scale, 2)
    log_r, comps = bounds.naf_components(rule, x, base=base, m=min(10, vocab - 1))
    log_b = naf.normalize(base)
    lq = bounds.anchor(log_r, log_b, c).log_q
    cert = bounds.certify(rule, lq, comps)
    # the certificate formula holds for the mixture: t_x bounds its exact max log-ratio
    exact = (lq.unsqueeze(0) - comps).amax(-1).amax(0)
    assert (cert.t_x >= exact - f32_tol(-naf.LOG_FLOOR, ops=8)).all()
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(lq.exp(), 1, generator=g)  # (T, 1): drawn from q
    revealed = torch.cat([y, torch.topk(lq, top, -1).indices], -1) if top else y
    cost = bounds.token_cost(lq, comps, revealed, cert.t_x)
    anchor = base_charge(lq, log_b, revealed)
    # per position: the realized max ratio of what was shown, clipped at 0 (no slack)
    lr_i = torch.stack(
        [bounds.realized_log_lr(lq, comps, revealed[:, j]) for j in range(revealed.shape[1])]
    )  # (R, K, T)
    lr_b = torch.stack(
        [
            (lq.gather(-1, revealed[:, j : j + 1]) - log_b.gather(-1, revealed[:, j : j + 1]))[:, 0]
            for j in range(revealed.shape[1])
        ]
    )  # (R, T)
    # (t_x caps the charge; where the cap binds, t_x and the realized max are one number
    # computed in two float32 ways: a few ulps of the log-probs apart)
    rounding = f32_tol(-naf.LOG_FLOOR, ops=4)
    torch.testing.assert_close(cost, lr_i.amax(0).amax(0).clamp_min(0), atol=rounding, rtol=0)
    torch.testing.assert_close(anchor, lr_b.amax(0).clamp_min(0), atol=rounding, rtol=0)
    assert (anchor <= c + f32_tol(-naf.LOG_FLOOR, c, ops=2)).all()
    # the sums bound the sequence's log-likelihood ratio against every p~_i and the base
    seq_i = bounds.realized_log_lr(lq, comps, y[:, 0]).double().sum(-1)  # (K,)
    seq_b = (lq.gather(-1, y) - log_b.gather(-1, y)).double().sum()
    assert (seq_i <= cost.double().sum() + 1e-5).all()
    assert seq_b <= anchor.double().sum() + 1e-5
    assert anchor.double().sum() <= t * c + 1e-4


# ------------------------------------------------------------------------------------------------
# the fallback rule


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(1, 30),
    budget=st.sampled_from([0.0, 0.5, 2.0, 5.0, math.inf]),
)
def test_private_prefix_is_the_runtime_ledger(seed, t, budget):
    g = torch.Generator().manual_seed(seed)
    worst = torch.rand(t, generator=g) * 2  # t_x of each position
    cost = worst * torch.rand(t, generator=g)  # realized <= t_x
    cost[torch.rand(t, generator=g) < 0.2] = 0.0
    mask = bounds.private_prefix(cost, worst, None if budget == math.inf else budget)
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any()  # a prefix
    assert cost[:n].double().sum() <= budget  # Proposition 3: within the budget
    if n < t:  # the first public position is one whose worst case the budget cannot cover
        assert cost[:n].double().sum() + worst[n].double() > budget
    led = Ledger(SamplingParams(budget=None if budget == math.inf else budget, on_budget="base"))
    assert led.count(cost.tolist(), worst.tolist(), []) == n  # the runtime's rule
    with pytest.raises(ValueError, match="shape of cost"):
        bounds.private_prefix(cost, worst[:-1] if t > 1 else worst[:0], 1.0)


def test_sampling_params_validate_the_modes():
    assert SamplingParams(on_budget="base", anchor=1, anchor_budget=3).anchor == 1.0
    with pytest.raises(ValueError, match="on_budget must be one of"):
        SamplingParams(on_budget="fallback")
    with pytest.raises(ValueError, match="anchor must be None or a finite number"):
        SamplingParams(anchor=-1.0)
    with pytest.raises(ValueError, match="set anchor=c too"):
        SamplingParams(anchor_budget=2.0)


# ------------------------------------------------------------------------------------------------
# acceptance: recomputed from the raw constituents and base


@pytest.fixture(scope="module")
def lm(tiny_bundle) -> ProtectedLM:
    out = ProtectedLM.from_bundle(tiny_bundle, method="scp-delta-r")
    assert out.name == "scp-delta-r-b"
    return out


@pytest.fixture(scope="module")
def raw(tiny_bundle):
    mf = models.read_bundle(tiny_bundle)
    cons = [models.load_model(mf.resolve(tiny_bundle, r)) for r in mf.constituents]
    return cons, models.load_model(mf.resolve(tiny_bundle, mf.base))


def _recompute(lm, raw, prompt: list[int], g: Generation, c: float | None):
    """From one uncached forward of each raw model over prompt + completion: for every served
    position (echoed prompt positions, then the completion) the served distribution
    (anchored, or the floored base after a fallback), the smoothed p~_i, the base and the
    token; and the private positions' t_x."""
    cons, base = raw
    ids = torch.tensor([prompt + g.token_ids])
    n = len(prompt)
    with torch.inference_mode():
        logits = torch.stack([m(input_ids=ids).logits[0].float() for m in cons])  # (K, T, V)
        blog = base(input_ids=ids).logits[0].float()  # (T, V)
    echoed = g.prompt_logprobs is not None
    first = 0 if echoed else n - 1  # position t predicts token t + 1
    sl = slice(first, n - 1 + len(g.token_ids))
    log_r, comps = bounds.naf_components("scp-delta-r", logits[:, sl], base=blog[sl], m=lm.m)
    log_b = naf.normalize(blog[sl])
    if c is not None:
        log_r = bounds.anchor(log_r, log_b, c).log_q
    t_x = bounds.certify("scp-delta-r", log_r, comps).t_x
    private = torch.ones(log_r.shape[0], dtype=torch.bool)
    n_prompt = n - 1 if echoed else 0
    pfall = g.prompt_logprobs.fallback_at if echoed else None
    if pfall is not None:
        private[pfall:] = False
    elif g.fallback_at is not None:
        private[n_prompt + g.fallback_at :] = False
    served = torch.where(private.unsqueeze(-1), log_r, log_b)
    y = ids[0, sl.start + 1 : sl.stop + 1]
    return served, comps, log_b, y, private, t_x, n_prompt


MODES = [
    dict(budget=0.3),
    dict(budget=0.3, on_budget="base"),
    dict(anchor=0.05, budget=0.3),
    dict(anchor=0.05, budget=0.15, on_budget="base"),
    dict(anchor=0.02, anchor_budget=0.05, on_budget="base"),
    dict(budget=0.4, on_budget="base", echo=True),
    dict(anchor=0.05, budget=0.5, on_budget="base", echo=True),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_acceptance_every_budgeted_response_is_certified_against_constituents_and_base(
    lm, raw, mode, temperature
):
    encoded = [list(lm.tokenizer(p)["input_ids"]) for p in PROMPTS]
    c = mode.get("anchor")
    fell = 0
    for seed in range(3) if temperature else [0]:
        gens = lm.generate(
            encoded,
            max_new_tokens=10,
            temperature=temperature,
            seed=seed,
            top_logprobs=2,
            stop_at_eos=False,
            **mode,
        )
        for ids, g in zip(encoded, gens, strict=True):
            served, comps, log_b, y, private, t_x, n_prompt = _recompute(lm, raw, ids, g, c)
            # the runtime served exactly these distributions
            got = [*(g.prompt_logprobs.token_logprobs if n_prompt else []), *g.logprobs]
            lp = served.gather(-1, y[:, None])[:, 0]
            torch.testing.assert_close(lp, torch.tensor(got), atol=2e-4, rtol=0)
            tol = FORWARD_TOL * len(y)
            # against every p~_i: the private positions' log-ratios (a base position is served
            # the base by the reference process too: 0)
            ratio_i = bounds.realized_log_lr(served, comps, y).double()  # (K, T)
            seq_i = (ratio_i * private).sum(-1)
            assert (seq_i <= g.sum_cost + tol).all(), (seq_i, g.sum_cost)
            # against the base: every position's log-ratio (0 at a base position)
            seq_b = (lp.double() - log_b.gather(-1, y[:, None])[:, 0].double()).sum()
            assert g.sum_anchor is not None and seq_b <= g.sum_anchor + tol
            assert g.sum_cost <= g.sum_t_x + 1e-9
            if c is not None:  # the ball, at every private position and token
                d = (served - log_b)[private].abs().max()
                assert d <= c + f32_tol(-naf.LOG_FLOOR, c, ops=8) + FORWARD_TOL
            if mode.get("budget") is not None:
                assert g.sum_cost <= mode["budget"] + 1e-9
            if mode.get("anchor_budget") is not None:
                assert g.sum_anchor <= mode["anchor_budget"] + 1e-9
            if mode.get("on_budget") != "base":
                continue
            # a fallback answers to the end, and switched only where it had to
            assert g.finish_reason == "length" and len(g.token_ids) == 10
            fell += g.fallback_at is not None
            if mode.get("budget") is not None and not private.all():
                k = int(private.sum())  # the first base position
                spent = math.fsum([*(g.prompt_logprobs.cost if n_prompt else []), *g.cost][:k])
                assert spent + float(t_x[k]) > mode["budget"] - FORWARD_TOL * (k + 1)
            assert g.private_tokens == (
                len(g.token_ids) if g.fallback_at is None else g.fallback_at
            )
            assert all(v == 0 for v in g.cost[g.private_tokens :])
            assert all(v == 0 for v in (g.anchor or [])[g.private_tokens :])
    if mode.get("on_budget") == "base":
        assert fell > 0  # the budgets of MODES are small enough to switch


def test_fallback_without_a_budget_is_the_plain_response_and_errors_name_the_fix(lm, tiny_bundle):
    kw = dict(max_new_tokens=6, temperature=1.0, seed=4, top_logprobs=1, stop_at_eos=False)
    plain = lm.generate(PROMPTS, **kw)
    base = lm.generate(PROMPTS, on_budget="base", **kw)
    for a, b in zip(plain, base, strict=True):
        assert a.token_ids == b.token_ids and a.cost == b.cost and b.fallback_at is None
        assert a.anchor is None and b.anchor is not None  # measured only where asked for
    cp = ProtectedLM.from_bundle(tiny_bundle, method="cp-delta-r")
    for bad in (dict(on_budget="base", budget=1.0), dict(anchor=0.5)):
        with pytest.raises(ValueError, match="runs no base model"):
            cp.generate(PROMPTS, max_new_tokens=2, **bad)
    with pytest.raises(ValueError, match="runs none"):
        cp.score(torch.tensor([[1, 2, 3]]), anchor=0.5)


def test_score_reads_off_what_generate_serves(lm):
    """The teacher-forced trace (``score(..., anchor=c, base=True)``) gives the anchored
    log-probs generate served, and ``private_prefix`` on it the fallback generate took: the
    read-off a budget sweep uses."""
    ids = list(lm.tokenizer(PROMPTS[0])["input_ids"])
    n = len(ids)
    (g,) = lm.generate([ids], max_new_tokens=10, temperature=0.0, anchor=0.05, stop_at_eos=False)
    seq = torch.tensor([ids + g.token_ids])
    out = lm.score(seq, anchor=0.05, base=True, cost=True, t_x=True)
    torch.testing.assert_close(
        out.token_logprobs[0, n - 1 :], torch.tensor(g.logprobs), atol=2e-4, rtol=0
    )
    assert out.anchor is not None and out.base_token_logprobs is not None
    budget = 0.15
    (fb,) = lm.generate(
        [ids],
        max_new_tokens=10,
        temperature=0.0,
        anchor=0.05,
        budget=budget,
        on_budget="base",
        stop_at_eos=False,
    )
    assert fb.fallback_at is not None
    assert fb.token_ids[: fb.fallback_at] == g.token_ids[: fb.fallback_at]
    cost, tx = out.cost[0, n - 1 :], out.t_x[0, n - 1 :]
    fewest = int(bounds.private_prefix(cost + FORWARD_TOL, tx + FORWARD_TOL, budget).sum())
    most = int(
        bounds.private_prefix((cost - FORWARD_TOL).clamp_min(0), tx - FORWARD_TOL, budget).sum()
    )
    assert fewest <= fb.fallback_at <= most
    # after the switch, the served log-probs are the base's
    k = fb.fallback_at
    full = lm.score(torch.tensor([ids + fb.token_ids]), base=True)
    torch.testing.assert_close(
        full.base_token_logprobs[0, n - 1 + k :], torch.tensor(fb.logprobs[k:]), atol=2e-4, rtol=0
    )
