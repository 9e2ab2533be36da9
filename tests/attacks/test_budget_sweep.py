"""The budget sweep (``scpdr.attacks.budget``): without a budget it equals the attacks it
truncates (PII extraction, utility, the ratio membership scores); with one, each example is one
response held to B — what is served has a certificate <= B, and against the clean constituent
(CP-Δr's reference r_0 = q, Thm. 4.4) every membership score is <= B (docs/accountant.md,
Corollary 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scpdr import bounds, models
from scpdr.attacks.budget import (
    BudgetOptions,
    answer_traces,
    budget_sweep,
    echo_traces,
    served_counts,
)
from scpdr.attacks.mia import MIAScores, ratio_score
from scpdr.attacks.pii import PIIRecord, pii_extraction
from scpdr.attacks.scorer import batched_token_logprobs, encode
from scpdr.attacks.utility import utility
from scpdr.runtime import ProtectedLM

NAMES = ["Alice Smith", "Bob Jones", "Carol White", "Dan Brown"]
IDS = ["1234567890", "5550001234", "9876543210", "1112223334"]
TEXTS = [f"Name: {n}, ID: {i}" for n, i in zip(NAMES, IDS, strict=True)]
VAL = [
    "The weather explains the results of the study today.",
    "Hello there, how are you doing my friend?",
    "A quick brown fox jumps over the lazy dog.",
    "Name: Erin Gray, ID: 4445556667",
]
RECORDS = [PIIRecord(n, i) for n, i in zip(NAMES, IDS, strict=True)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from scpdr.testing import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("budget") / "b", prefer={0: TEXTS})


@pytest.fixture(scope="module")
def lms(bundle):
    return {m: ProtectedLM.from_bundle(bundle, method=m) for m in ("none", "cp-delta-r")}


@pytest.fixture(scope="module")
def q(bundle):
    """The constituent that never saw the PII texts, alone: the reference r_0 = q of Thm. 4.4."""
    mf = models.read_bundle(bundle)
    tok = models.load_tokenizer(mf.resolve(bundle, mf.tokenizer))
    return ProtectedLM.from_model(models.load_model(mf.resolve(bundle, mf.constituents[1])), tok)


def _rows(rows, metric):
    return {r.extra["budget"]: r for r in rows if r.metric == metric}


def test_served_counts_is_the_runtime_rule():
    costs = [[0.5, 0.5, 2.0], [], [3.0], [0.0, 0.0]]
    assert served_counts(costs, 1.0).tolist() == [2, 0, 0, 2]
    assert served_counts(costs, None).tolist() == [3, 0, 1, 2]
    assert served_counts([[math.inf, 0.0]], 1e9).tolist() == [0]


@pytest.mark.parametrize("method", ["none", "cp-delta-r"])
def test_unbudgeted_sweep_equals_the_attacks_and_budgets_only_take_away(lms, q, method):
    lm = lms[method]
    budgets = (0.5, 5.0, 50.0, None)
    rows = budget_sweep(
        lm,
        method=method,
        pii=RECORDS,
        validation=VAL,
        members=TEXTS,
        nonmembers=VAL,
        references={"lira": q},
        options=BudgetOptions(budgets=budgets, answer_tokens=6),
        corpus="c",
    )
    pii = pii_extraction(lm, RECORDS)
    ael, fer = _rows(rows, "pii_ael"), _rows(rows, "pii_fer")
    assert ael[None].value == pytest.approx(pii.ael) and fer[None].value == pytest.approx(pii.fer)
    acc = _rows(rows, "accuracy")
    assert acc[None].value == pytest.approx(utility(lm, VAL).accuracy)
    tokens = _rows(rows, "tokens_per_answer")
    for metric in (ael, fer, acc, tokens):  # more budget never serves less
        values = [metric[b].value for b in budgets]
        assert values == sorted(values)
    if method == "none":  # no certificate: nothing is served under any finite budget
        assert tokens[50.0].value == 0 and ael[50.0].value == 0 and acc[50.0].value == 0
        assert pii.fer == 1.0  # (the memorizing constituent gives every ID away without one)
    else:
        assert 0 < tokens[50.0].value
    for r in rows:
        assert r.attack == "budget" and r.corpus == "c"
        assert r.extra["ci_low"] <= r.value <= r.extra["ci_high"] or r.n < 2
    # the unbudgeted membership scores are the suite's ratio scores of the whole examples
    seqs = [encode(lm.tokenizer, t) for t in [*TEXTS, *VAL]]
    scores = MIAScores(method)
    t_lp = batched_token_logprobs(lm, seqs)
    r_lp = batched_token_logprobs(q, seqs)
    for i, (t, r) in enumerate(zip(t_lp, r_lp, strict=True)):
        scores.add("lira", member=i < len(TEXTS), score=ratio_score(t.numpy(), r.numpy()))
    auc = _rows(rows, "lira_auc")[None]
    assert auc.value == pytest.approx(scores.metrics("lira").auc.value)


def test_budgeted_membership_scores_are_at_most_the_budget(lms, q):
    """Corollary 2.1 on what the sweep measures: CP-Δr's served prefix of every example has a
    log-likelihood ratio against the clean constituent (floored, as the charge's) <= B."""
    lm = lms["cp-delta-r"]
    seqs = [encode(lm.tokenizer, t) for t in [*TEXTS, *VAL]]
    traces = echo_traces(lm, seqs)
    ref = [t.double().numpy() for t in batched_token_logprobs(q, seqs)]
    served = 0
    for budget in (0.5, 2.0, 8.0, 20.0):
        n = served_counts([t.cost for t in traces], budget)
        served += int(n.sum())
        for t, r, k in zip(traces, ref, n, strict=True):
            assert float(t.cost[:k].sum()) <= budget
            assert float(np.sum(t.logprobs[:k] - r[:k])) <= budget + 1e-3
    assert served > len(traces)  # the test means something


def test_answer_traces_are_the_runtime_budget(lms):
    lm = lms["cp-delta-r"]
    prompts = [encode(lm.tokenizer, v)[:6] for v in VAL]
    costs = answer_traces(lm, prompts, max_new_tokens=8)
    for budget in (1.0, 6.0):
        gens = lm.generate(prompts, max_new_tokens=8, temperature=0.0, budget=budget)
        assert [len(g.token_ids) for g in gens] == served_counts(costs, budget).tolist()
    assert bounds.within_budget(torch.tensor(costs[0]), None).all()
