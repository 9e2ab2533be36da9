"""The accountant in the runtime: ``ProtectedLM.generate(..., budget=)`` on a tiny bundle.

Acceptance (issue 16): with ``method="cp-delta-r"`` the realized log-likelihood ratio of every
emitted sequence against each raw constituent, recomputed from the models directly (e^-20
floor), is <= Σ cost <= Σ t_x. And the budget rule: a budgeted generation is the unbudgeted one
cut before the first token whose charge would take the running sum past the budget.
"""

from __future__ import annotations

import math

import pytest
import torch

from scpdr import bounds, methods, models, naf
from scpdr.runtime import Generation, ProtectedLM, SamplingParams
from scpdr.testing import f32_tol

PROMPTS = ["My secret code is", "Hello there, how are", "x"]
#: Rules ProtectedLM runs that certify something (all but "none").
CERTIFIED = tuple(r for r in methods.RULES if r != "none")
#: How far one position's charge may move between two forward paths of the tiny bundle that
#: round differently (teacher-forced vs KV-cached, a batch of three vs fewer rows, another
#: CPU's matmul kernels). Every log-prob a charge is made of lies in [-20 - log(1 + V·e^-20), 0]
#: (the e^-20 floor), so M = 20; ops: each of the 2 layers has 4 reductions that the paths sum
#: in other orders (attention scores, attention · V, the MLP's two projections), each a few
#: (2) ulps of M; log-softmax moves a log-prob by at most twice its logits' change, and a charge
#: is a difference of two log-probs: 2 · 4 · 2 · 2 · 2 = 64 ulps of 20, 1.5e-4 nats. (Measured:
#: at most 7e-6, on AVX-512 and on AVX2 torch kernels.) A wrong charge is off by 1e-2 or more.
FORWARD_TOL = f32_tol(-naf.LOG_FLOOR, ops=64)


def running_sums(costs) -> list[float]:
    """The float64 running sums of ``costs`` in the runtime's arithmetic (one addition per
    position, from 0.0, in order: ``served_prefix``)."""
    out, spent = [], 0.0
    for c in costs:
        spent += float(c)
        out.append(spent)
    return out


def stop_window(cost, budget: float, tol: float) -> tuple[int, int]:
    """``(fewest, most)`` positions a budget may serve when each charge of ``cost`` is known to
    ``± tol`` (computed by another forward path): the budget rule on the charges all raised by
    ``tol`` and all lowered by it (``docs/accountant.md``, "Two forward paths at a budget's
    edge")."""
    c = torch.as_tensor(cost, dtype=torch.float64)
    fewest = int(bounds.within_budget(c + tol, budget).sum())
    most = int(bounds.within_budget((c - tol).clamp_min(0.0), budget).sum())
    return fewest, most


@pytest.fixture(scope="module")
def lms(tiny_bundle):
    cache: dict[str, ProtectedLM] = {}

    def get(method: str) -> ProtectedLM:
        if method not in cache:
            cache[method] = ProtectedLM.from_bundle(tiny_bundle, method=method)
        return cache[method]

    return get


@pytest.fixture(scope="module")
def constituents(tiny_bundle):
    mf = models.read_bundle(tiny_bundle)
    return [models.load_model(mf.resolve(tiny_bundle, r)) for r in mf.constituents]


def _recomputed_log_lr(constituents, prompt_ids, g: Generation) -> torch.Tensor:
    """log r(y) - log p_i(y) summed over the generated tokens, with r = CP-Δr of the raw
    constituents and p_i their floored distributions, from one uncached forward per model."""
    ids = torch.tensor([prompt_ids + g.token_ids])
    n, t = len(prompt_ids), len(g.token_ids)
    with torch.inference_mode():
        logits = torch.stack(
            [m(input_ids=ids).logits[0, n - 1 : n - 1 + t].float() for m in constituents]
        )
    log_r = naf.aggregate("cp-delta-r", logits)  # (T, V)
    logps = naf.normalize(logits)  # (K, T, V): the e^-20 floor
    y = torch.tensor(g.token_ids)
    torch.testing.assert_close(
        log_r.gather(-1, y[:, None]).squeeze(-1), torch.tensor(g.logprobs), atol=2e-4, rtol=0
    )
    return bounds.realized_log_lr(log_r, logps, y).double().sum(-1)  # (K,)


@pytest.mark.parametrize("top", [0, 5])
def test_acceptance_cp_delta_r_sequence_log_lr_is_at_most_sum_cost_at_most_sum_t_x(
    lms, constituents, top
):
    lm = lms("cp-delta-r")
    encoded = [list(lm.tokenizer(p)["input_ids"]) for p in PROMPTS]
    for seed in range(4):
        gens = lm.generate(
            encoded,
            max_new_tokens=12,
            temperature=1.0,
            seed=seed,
            top_logprobs=top,
            stop_at_eos=False,
        )
        for ids, g in zip(encoded, gens, strict=True):
            assert len(g.cost) == len(g.t_x) == len(g.token_ids) == 12
            seq = _recomputed_log_lr(constituents, ids, g)
            assert g.sum_cost <= g.sum_t_x + 1e-9
            assert (seq <= g.sum_cost + 1e-3).all(), (seq, g.sum_cost)
            assert all(0 <= c <= t + 1e-7 for c, t in zip(g.cost, g.t_x, strict=True))


def test_contract_generate_returns_cost_and_finish_reason(lms):
    lm = lms("scp-delta-r")
    out = lm.generate(PROMPTS, max_new_tokens=6, temperature=0.7, seed=3, budget=None)
    for g in out:
        n = len(g.token_ids)
        assert len(g.logprobs) == len(g.t_x) == len(g.cost) == n
        assert g.finish_reason in ("length", "stop", "budget")
        assert g.sum_cost == pytest.approx(sum(g.cost)) and g.sum_t_x == pytest.approx(sum(g.t_x))


@pytest.mark.parametrize("method", CERTIFIED)
@pytest.mark.parametrize("budget", [0.0, 0.3, 1.0])
def test_budget_cuts_the_unbudgeted_generation_before_the_first_token_past_it(lms, method, budget):
    lm = lms(method)
    kw = dict(max_new_tokens=10, temperature=1.0, seed=11, top_logprobs=2, stop_at_eos=False)
    full = lm.generate(PROMPTS, **kw)
    cut = lm.generate(PROMPTS, budget=budget, **kw)
    for f, c in zip(full, cut, strict=True):
        # Rows leave the budgeted batch at other steps than the unbudgeted one: from then on the
        # two forwards run other batch shapes and round differently (FORWARD_TOL per charge),
        # so the cut may land one position off where a running sum is that close to the budget.
        fewest, most = stop_window(f.cost, budget, FORWARD_TOL)
        n = len(c.token_ids)
        assert fewest <= n <= most, (n, fewest, most, f.cost)
        assert c.token_ids == f.token_ids[:n]
        assert c.cost == pytest.approx(f.cost[:n], abs=FORWARD_TOL)
        assert c.t_x == pytest.approx(f.t_x[:n], abs=f32_tol(f.t_x, -naf.LOG_FLOOR, ops=64))
        assert c.sum_cost <= budget  # the rule on its own charges: exact
        assert c.finish_reason == ("budget" if n < len(f.token_ids) else f.finish_reason)
        if n < len(f.token_ids):
            assert c.sum_cost + f.cost[n] > budget - FORWARD_TOL * (n + 1)


def test_no_certificate_means_no_token_under_any_budget(lms):
    lm = lms("none")
    (g,) = lm.generate(["Hello"], max_new_tokens=4, temperature=0.0, budget=1e6)
    assert g.token_ids == [] and g.finish_reason == "budget" and g.text == ""
    (g,) = lm.generate(["Hello"], max_new_tokens=4, temperature=0.0)
    assert len(g.token_ids) == 4 and g.sum_cost == math.inf


def test_echoed_prompt_positions_are_charged_and_cut(lms):
    lm = lms("cp-delta-r")
    prompt = "Hello there, how are you doing today"
    (full,) = lm.generate([prompt], max_new_tokens=5, temperature=0.0, echo=True, top_logprobs=3)
    pl = full.prompt_logprobs
    assert pl is not None and len(pl.cost) == len(pl.token_logprobs) == len(pl.t_x) > 3
    assert all(0 <= c <= t + 1e-7 for c, t in zip(pl.cost, pl.t_x, strict=True))
    assert full.sum_cost == pytest.approx(sum(pl.cost) + sum(full.cost))
    # the same prompt positions cost the same teacher-forced (score) and echoed (the prefill
    # forward, which also fills the KV cache: other arithmetic, FORWARD_TOL)
    ids = torch.tensor([full.prompt_token_ids])
    out = lm.score(ids, cost=True, top_logprobs=3)
    assert out.cost[0].tolist() == pytest.approx(pl.cost, abs=FORWARD_TOL)
    # a budget the echo alone exceeds: the prompt's log-probs stop there and nothing is generated
    # (generate on the same prompt alone runs the same arithmetic: the same charges, exactly)
    budget = sum(pl.cost[:2]) + pl.cost[2] / 2
    (cut,) = lm.generate(
        [prompt], max_new_tokens=5, temperature=0.0, echo=True, top_logprobs=3, budget=budget
    )
    assert cut.prompt_logprobs.token_logprobs == pl.token_logprobs[:2]
    assert cut.prompt_logprobs.served == 2 and cut.prompt_logprobs.cost == pl.cost[:2]
    assert cut.token_ids == [] and cut.finish_reason == "budget"
    # a budget the echo fits in: the completion gets what is left
    budget = sum(pl.cost) + sum(full.cost[:2]) + 1e-9
    (rest,) = lm.generate(
        [prompt], max_new_tokens=5, temperature=0.0, echo=True, top_logprobs=3, budget=budget
    )
    assert rest.prompt_logprobs.served == len(pl.cost)
    assert rest.token_ids == full.token_ids[:2] and rest.finish_reason == "budget"


def _teacher_forced(lm, prompt, g) -> torch.Tensor:
    """score(cost=True)'s charges of the generated positions of ``g`` (float32, one a token)."""
    out = lm.score(
        torch.tensor([prompt + g.token_ids]),
        prompt_lengths=[len(prompt)],
        cost=True,
        top_logprobs=4,
    )
    return out.cost[0, len(prompt) - 1 :]


def test_teacher_forced_cost_matches_generation_and_the_budget(lms):
    """score(cost=True) over prompt + completion charges the completion's positions what generate
    charged them (with the same alternatives revealed) to float32 rounding of the two forward
    paths (FORWARD_TOL), so a scorer can apply a budget: its stop is generate's, or one position
    away where a running sum lies within that rounding of the budget."""
    lm = lms("scp-delta-r")
    prompt = list(lm.tokenizer("My secret code is")["input_ids"])
    (g,) = lm.generate([prompt], max_new_tokens=8, temperature=1.0, seed=5, top_logprobs=4)
    tail = _teacher_forced(lm, prompt, g)
    assert tail.tolist() == pytest.approx(g.cost, abs=FORWARD_TOL)
    (cut,) = lm.generate(
        [prompt], max_new_tokens=8, temperature=1.0, seed=5, top_logprobs=4, budget=0.2
    )
    fewest, most = stop_window(g.cost, 0.2, FORWARD_TOL)
    assert fewest <= int(bounds.within_budget(tail, 0.2).sum()) <= most
    assert fewest <= len(cut.token_ids) <= most and most - fewest <= 1


def test_a_budget_on_a_running_sum_stops_teacher_forced_at_most_one_position_off(lms):
    """Budgets placed exactly on each running sum of a generation's charges, one float64 step
    either side of it and half a FORWARD_TOL either side: generate stops exactly where its own
    charges say (the budgeted run is the same arithmetic as the unbudgeted one), and the budget
    rule on score(cost=True)'s charges stops at most one position from it."""
    lm = lms("scp-delta-r")
    prompt = list(lm.tokenizer("Hello there, how are")["input_ids"])
    kw = dict(max_new_tokens=6, temperature=1.0, seed=2, top_logprobs=4, stop_at_eos=False)
    (g,) = lm.generate([prompt], **kw)
    tail = _teacher_forced(lm, prompt, g)
    assert len(g.cost) == 6 and min(g.cost) > 2 * FORWARD_TOL  # else a window spans 2+ stops
    budgets = [0.0]
    for s in running_sums(g.cost):
        near = (math.nextafter(s, -1.0), s, math.nextafter(s, math.inf))
        budgets += [*near, max(0.0, s - FORWARD_TOL / 2), s + FORWARD_TOL / 2]
    for budget in budgets:
        (cut,) = lm.generate([prompt], budget=budget, **kw)
        n = len(cut.token_ids)
        assert n == sum(s <= budget for s in running_sums(g.cost)), budget  # exact
        assert cut.token_ids == g.token_ids[:n] and cut.cost == g.cost[:n]
        scored = int(bounds.within_budget(tail, budget).sum())
        fewest, most = stop_window(g.cost, budget, FORWARD_TOL)
        assert fewest <= scored <= most and most - fewest <= 1, (budget, n, scored)
        assert abs(scored - n) <= 1
    # budgets off every running sum by more than the rounding: both stop at the same position
    sums = running_sums(g.cost)
    for s, nxt in zip([0.0, *sums[:-1]], sums, strict=True):
        budget = (s + nxt) / 2
        (cut,) = lm.generate([prompt], budget=budget, **kw)
        assert len(cut.token_ids) == int(bounds.within_budget(tail, budget).sum())


def test_stream_ends_with_a_budget_event_and_per_row_budgets(lms):
    lm = lms("cp-delta-r")
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.0, budget=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.0, budget=None),
        SamplingParams(max_new_tokens=8, temperature=0.0, budget=0.5),
    ]
    events = list(lm.generate_stream(PROMPTS, sampling=params))
    last = {ev.index: ev for ev in events}
    assert last[0].finish_reason == "budget" and last[0].token_id is None
    assert last[1].finish_reason == "length"
    spent = {
        i: sum(ev.cost for ev in events if ev.index == i and ev.token_id is not None)
        for i in range(3)
    }
    assert spent[0] == 0.0 and spent[2] <= 0.5
    assert all(ev.cost is not None for ev in events if ev.token_id is not None)


@pytest.mark.parametrize("bad", [-0.1, math.nan, "1", True])
def test_budget_is_validated(bad):
    with pytest.raises(ValueError, match="budget"):
        SamplingParams(budget=bad)
    assert (
        SamplingParams(budget=2).budget == 2.0
        and SamplingParams(budget=math.inf).budget == math.inf
    )
