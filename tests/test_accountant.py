"""The NAF accountant (``scpdr.bounds.accountant``) as a theorem: per position, the realized
log-likelihood ratio of every revealed token against every component <= cost <= t_x; per
sequence (chain rule), the sequence's log-LR against each component <= Σ cost <= Σ t_x; a budget
serves a prefix whose log-LR is <= the budget. Random constituents, sampled sequences."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scpdr import bounds, methods, naf
from scpdr.testing import correlated_logits

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-4
#: Rules certified by a theorem (the stateless ones with K >= 2 components).
RULES = tuple(r for r in methods.RULES if r in methods.STATELESS_RULES and r != "none")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


def _aggregate(rule: str, x: torch.Tensor, base: torch.Tensor, m: int):
    return bounds.naf_components(
        rule, x, base=base if rule in methods.SMOOTHED_RULES else None, m=m
    )


# ------------------------------------------------------------------------------------------------
# one position


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    rule=st.sampled_from(RULES),
    k=st.integers(2, 3),
    vocab=st.integers(12, 200),
    scale=st.sampled_from([0.1, 1.0, 4.0, 12.0]),
    spikes=st.integers(0, 3),
    n_revealed=st.integers(1, 6),
)
def test_cost_bounds_every_revealed_token_and_is_at_most_t_x(
    seed, rule, k, vocab, scale, spikes, n_revealed
):
    x, base = correlated_logits(seed, k, (4,), vocab, scale, spikes)
    log_r, comps = _aggregate(rule, x, base, m=min(10, vocab - 1))
    g = torch.Generator().manual_seed(seed + 1)
    revealed = torch.randint(0, vocab, (4, n_revealed), generator=g)
    revealed[1, 1:] = -1  # a row that reveals only its token
    ch = bounds.charge(rule, log_r, comps, revealed)
    assert torch.isfinite(ch.cost).all()
    assert (ch.cost >= 0).all() and (ch.cost <= ch.t_x).all()
    assert torch.equal(ch.t_x, bounds.certify(rule, log_r, comps).t_x)  # the one formula
    for j in range(n_revealed):
        z = revealed[:, j]
        lr = bounds.realized_log_lr(log_r, comps, z.clamp_min(0))  # (K, 4)
        shown = z >= 0
        assert (lr[:, shown] <= ch.cost[shown] + TOL).all()
    # the charge is the realized max (clipped at 0): revealing more never costs less
    emitted = bounds.charge(rule, log_r, comps, revealed[:, :1]).cost
    assert (emitted <= ch.cost + 1e-7).all()
    lr0 = bounds.realized_log_lr(log_r, comps, revealed[:, 0]).amax(0).clamp_min(0)
    torch.testing.assert_close(emitted, torch.minimum(lr0, ch.t_x))


def test_cp_delta_r_t_x_is_the_max_realized_ratio_against_q():
    """For CP-Δr (K = 2) Thm. 4.4 is tight: revealing every token costs t_x exactly."""
    x, _ = correlated_logits(3, 2, (5,), 50, 2.0, 2)
    log_r, comps = bounds.naf_components("cp-delta-r", x)
    everything = torch.arange(50).expand(5, 50)
    ch = bounds.charge("cp-delta-r", log_r, comps, everything)
    torch.testing.assert_close(ch.cost, ch.t_x, atol=1e-4, rtol=0)


def test_no_certificate_costs_inf_and_nothing_revealed_costs_zero():
    x, _ = correlated_logits(0, 1, (3,), 20, 1.0, 0)
    log_r, comps = bounds.naf_components("none", x)
    ch = bounds.charge("none", log_r, comps, torch.zeros(3, 1, dtype=torch.long))
    assert torch.isinf(ch.cost).all() and torch.isinf(ch.t_x).all()
    x, _ = correlated_logits(0, 2, (3,), 20, 1.0, 0)
    log_r, comps = bounds.naf_components("cp-delta", x)
    t_x = bounds.certify("cp-delta", log_r, comps).t_x
    nothing = torch.full((3, 2), -1)
    assert (bounds.token_cost(log_r, comps, nothing, t_x) == 0).all()
    assert (bounds.token_cost(log_r, comps, nothing[:, :0], t_x) == 0).all()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["-inf", "extreme", "bf16", "equal"])
def test_costs_are_finite_for_hard_logits(rule, kind):
    x, base = correlated_logits(7, 2, (3,), 40, 3.0, 1)
    if kind == "-inf":
        x[0, :, :10] = -math.inf  # tokens one constituent rules out
        x[1, :, 5:15] = -math.inf
        base[:, :3] = -math.inf
    elif kind == "extreme":
        x = x * 1e4
        base = base * 1e4
    elif kind == "bf16":
        x, base = x.bfloat16(), base.bfloat16()
    else:
        x[1] = x[0]  # identical constituents: r = p = q, nothing to learn
    log_r, comps = _aggregate(rule, x, base, m=5)
    revealed = torch.arange(40).expand(3, 40)  # every token
    ch = bounds.charge(rule, log_r, comps.bfloat16() if kind == "bf16" else comps, revealed)
    assert torch.isfinite(ch.cost).all() and torch.isfinite(ch.t_x).all()
    assert (ch.cost >= 0).all() and (ch.cost <= ch.t_x).all()
    if kind == "equal":
        assert ch.cost.max() < 1e-4


# ------------------------------------------------------------------------------------------------
# sequences: the chain rule


def _bigram(seed: int, k: int, vocab: int, scale: float, spikes: int):
    """K random autoregressive models and a base: the next-token logits depend on the position
    and the previous token (tables ``(K, T, V, V)``), enough context for the chain rule."""
    x, base = correlated_logits(seed, k, (6, vocab), vocab, scale, spikes)
    return x, base  # (K, T=6, prev=V, V), (T, prev, V)


def _sample(rule, x, base, m, seed, top):
    """Sample a sequence from r (temperature 1) step by step; return per-position log r,
    components, tokens and revealed sets as the runtime sees them."""
    g = torch.Generator().manual_seed(seed)
    prev, rows = 0, []
    for t in range(x.shape[1]):
        lr, comps = _aggregate(rule, x[:, t, prev], base[t, prev], m)
        y = int(torch.multinomial(lr.exp(), 1, generator=g))
        shown = (
            torch.tensor([y, *torch.topk(lr, top).indices.tolist()]) if top else torch.tensor([y])
        )
        rows.append((lr, comps, y, shown))
        prev = y
    return rows


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    rule=st.sampled_from(RULES),
    k=st.integers(2, 3),
    vocab=st.integers(12, 60),
    scale=st.sampled_from([0.5, 2.0, 6.0]),
    spikes=st.integers(0, 2),
    top=st.integers(0, 3),
    budget=st.sampled_from([0.0, 0.05, 0.5, 2.0, math.inf]),
)
@example(seed=0, rule="cp-delta-r", k=2, vocab=12, scale=6.0, spikes=2, top=0, budget=0.5)
def test_sequence_log_lr_is_at_most_sum_cost_at_most_sum_t_x(
    seed, rule, k, vocab, scale, spikes, top, budget
):
    x, base = _bigram(seed, k, vocab, scale, spikes)
    rows = _sample(rule, x, base, min(5, vocab - 1), seed, top)
    lr = torch.stack([r[0] for r in rows])  # (T, V)
    comps = torch.stack([r[1] for r in rows], dim=1)  # (K, T, V)
    y = torch.tensor([r[2] for r in rows])
    shown = torch.nn.utils.rnn.pad_sequence(
        [r[3] for r in rows], batch_first=True, padding_value=-1
    )
    ch = bounds.charge(rule, lr, comps, shown)
    seq_lr = bounds.realized_log_lr(lr, comps, y).double().sum(-1)  # (K,) chain rule
    sum_cost, sum_t_x = bounds.response_certificate(ch.cost, ch.t_x)
    assert (seq_lr <= sum_cost + TOL * len(rows)).all()
    assert sum_cost <= sum_t_x + 1e-9
    # any path through the revealed alternatives is covered too
    alt = shown[:, -1].where(shown[:, -1] >= 0, y)
    assert (bounds.realized_log_lr(lr, comps, alt).double().sum(-1) <= sum_cost + 1e-3).all()
    # a budget serves a prefix whose certificate (hence log-LR) is within it
    served = bounds.within_budget(ch.cost, budget)
    n = int(served.sum())
    assert served[:n].all() and not served[n:].any()
    assert float(ch.cost[:n].double().sum()) <= budget
    assert (
        bounds.realized_log_lr(lr[:n], comps[:, :n], y[:n]).double().sum(-1) <= budget + 1e-3
    ).all()
    if n < len(rows):
        assert float(ch.cost[: n + 1].double().sum()) > budget


def test_sequence_charges_equal_the_positionwise_charge():
    x, base = correlated_logits(5, 2, (2, 7), 30, 2.0, 1)
    tokens = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(1))
    ch = bounds.sequence_charges("scp-delta-r", x, tokens, base=base, m=5, top_logprobs=2)
    log_r, comps = bounds.naf_components("scp-delta-r", x, base=base, m=5)
    shown = torch.cat([tokens.unsqueeze(-1), torch.topk(log_r, 2).indices], dim=-1)
    ref = bounds.charge("scp-delta-r", log_r, comps, shown)
    torch.testing.assert_close(ch.cost, ref.cost)
    torch.testing.assert_close(ch.k_x, bounds.k_x("scp-delta-r", x, base=base, m=5))


def test_within_budget_rule_and_errors():
    cost = torch.tensor([[0.5, 0.5, 0.0, 2.0, 0.1], [3.0, 0.0, 0.0, 0.0, 0.0]])
    assert bounds.within_budget(cost, 1.0).tolist() == [
        [True, True, True, False, False],  # a later cheap token is not served after a stop
        [False] * 5,
    ]
    assert bounds.within_budget(cost, None).all() and bounds.within_budget(cost, math.inf).all()
    for bad in (-1.0, math.nan, True, "1"):
        with pytest.raises(ValueError, match="budget"):
            bounds.within_budget(cost, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="revealed"):
        bounds.token_cost(
            torch.zeros(2, 5), torch.zeros(2, 2, 5), torch.zeros(3, 1).long(), torch.zeros(2)
        )
    with pytest.raises(TypeError, match="revealed"):
        bounds.token_cost(
            torch.zeros(2, 5), torch.zeros(2, 2, 5), torch.zeros(2, 1), torch.zeros(2)
        )
    log_r = naf.normalize(torch.zeros(5))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        bounds.realized_log_lr(log_r, log_r[None], torch.tensor(5))
