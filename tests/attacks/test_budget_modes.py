"""The budget sweep's serving mode as an axis (``scpdr.attacks.budget_modes``): the fallback read
off one unbudgeted trace is what ``generate(..., on_budget="base")`` serves, anchored traces are
what ``generate(..., anchor=c)`` serves, and every setting gets every membership test's AUC and
TPR@1% with 95% intervals plus utility rows (docs/accountant.md, "Budgets and attacks")."""

from __future__ import annotations

import numpy as np
import pytest

from scpdr import models
from scpdr.attacks.budget import BudgetOptions, budget_sweep
from scpdr.attacks.budget_modes import Setting, mode_echo_traces, served_view, settings
from scpdr.attacks.mia import MIA_ATTACKS
from scpdr.attacks.scorer import encode
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
#: float32 rounding between the KV-cached and the teacher-forced forward (tests/test_budget.py)
TOL = 2e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from scpdr.testing import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("modes") / "b", prefer={0: TEXTS})


@pytest.fixture(scope="module")
def lm(bundle) -> ProtectedLM:
    out = ProtectedLM.from_bundle(bundle, method="scp-delta-r")
    assert out.variant == "b"
    return out


def test_settings_grid():
    grid = settings(["stop", "fallback", "anchor"], [2.0, None], [0.5])
    assert [(s.mode, s.budget, s.anchor) for s in grid] == [
        ("stop", 2.0, None), ("stop", None, None), ("fallback", 2.0, None),
        ("fallback", None, None), ("anchor", None, 0.5),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown serving modes"):
        settings(["base"], [None], [])


@pytest.mark.parametrize("budget", [0.3, 1.0, 3.0])
def test_fallback_read_off_is_what_generate_serves(lm, budget):
    """The greedy response generate serves with ``on_budget="base"``, echoed as one sequence:
    the read-off (private prefix by ``private_prefix``, the base after) gives its log-probs."""
    prompt = encode(lm.tokenizer, VAL[1])[:5]
    (g,) = lm.generate(
        [prompt], max_new_tokens=10, temperature=0.0, budget=budget, on_budget="base",
        stop_at_eos=False,
    )  # fmt: skip
    seq = prompt + g.token_ids
    (tr,) = mode_echo_traces(lm, [seq])
    lp, *_ = served_view(tr, Setting("fallback", budget))
    # the echo's sum runs over the prompt's positions too; generate charges them the same way
    # (echoed prompt positions first) only when asked, so compare the completion's positions
    # under a read-off that starts at the prompt's end
    n = len(prompt) - 1
    sub = type(tr)(*(getattr(tr, f)[n:] for f in tr.__dataclass_fields__))
    lp, *_ = served_view(sub, Setting("fallback", budget))
    np.testing.assert_allclose(lp, np.array(g.logprobs), atol=TOL)
    k = len(g.token_ids) if g.fallback_at is None else g.fallback_at
    assert np.array_equal(lp[:k], sub.logprobs[:k]) and np.array_equal(
        lp[k:], sub.base_logprobs[k:]
    )


def test_anchored_trace_is_what_generate_serves(lm):
    prompt = encode(lm.tokenizer, VAL[0])[:5]
    (g,) = lm.generate([prompt], max_new_tokens=8, temperature=0.0, anchor=0.3, stop_at_eos=False)
    (tr,) = mode_echo_traces(lm, [prompt + g.token_ids], anchor=0.3)
    np.testing.assert_allclose(tr.logprobs[len(prompt) - 1 :], np.array(g.logprobs), atol=TOL)
    assert tr.correct[len(prompt) - 1 :].all()  # greedy: every served token is the argmax


def test_rows_exist_with_intervals_for_every_mode(lm, bundle):
    mf = models.read_bundle(bundle)
    base = ProtectedLM.from_model(models.load_model(mf.resolve(bundle, mf.base)), lm.tokenizer)
    budgets, anchors = (1.0, None), (0.5,)
    rows = budget_sweep(
        lm,
        method="scp-delta-r-b",
        validation=VAL,
        members=TEXTS,
        nonmembers=VAL,
        references={"ref": base},
        options=BudgetOptions(
            budgets=budgets, anchors=anchors, modes=("stop", "fallback", "anchor"), answer_tokens=6
        ),
    )
    keys = {("stop", b) for b in budgets} | {("fallback", b) for b in budgets} | {("anchor", 0.5)}
    for mode, x in keys:
        got = {
            r.metric: r
            for r in rows
            if r.extra["mode"] == mode
            and r.extra.get("anchor" if mode == "anchor" else "budget") == x
        }
        for test in MIA_ATTACKS:
            if test == "lira":
                continue  # no LiRA reference given
            for metric in ("auc", "tpr@0.01fpr"):
                r = got[f"{test}_{metric}"]
                assert r.extra["ci_low"] <= r.value <= r.extra["ci_high"], (mode, x, test)
        for metric in ("accuracy", "tokens_per_answer", "private_fraction"):
            r = got[metric]
            assert r.extra["ci_low"] <= r.value <= r.extra["ci_high"] or r.n < 2
    one = {(r.extra["mode"], r.extra["budget"], r.metric): r.value for r in rows}
    # unbudgeted, stop and fallback serve the same; a budget never serves more privately
    for m in ("accuracy", "tokens_per_answer", "ref_auc", "loss_auc"):
        assert one[("stop", None, m)] == pytest.approx(one[("fallback", None, m)])
    assert one[("fallback", 1.0, "private_fraction")] <= one[("fallback", None, "private_fraction")]
    assert one[("fallback", None, "private_fraction")] == 1.0
    # the fallback keeps answering where the stop rule ends the answer
    assert one[("fallback", 1.0, "tokens_per_answer")] >= one[("stop", 1.0, "tokens_per_answer")]
    assert one[("fallback", 1.0, "accuracy")] >= one[("stop", 1.0, "accuracy")] - 1e-9


def test_other_variants_keep_the_stop_rule_only(bundle):
    cp = ProtectedLM.from_bundle(bundle, method="cp-delta-r")
    rows = budget_sweep(
        cp, method="cp-delta-r", validation=VAL, members=TEXTS, nonmembers=VAL,
        references={"lira": cp},
        options=BudgetOptions(budgets=(None,), modes=("stop", "fallback"), answer_tokens=4),
    )  # fmt: skip
    assert rows and all(r.extra["mode"] == "stop" for r in rows)
    assert {"loss_auc", "min-k++_auc", "rmia_auc", "accuracy"} <= {r.metric for r in rows}


def test_pii_is_extracted_under_every_fallback_and_anchored_setting(lm, bundle):
    """PII AEL/FER rows per setting; at c = 0 the anchored aggregate is the base (Prop. 4), so
    its extraction is the base model's own, and the unbudgeted fallback serves what the stop
    rule's unbudgeted trace does."""
    from scpdr.attacks.budget import extracted_chars, pii_traces
    from scpdr.attacks.pii import PIIRecord

    records = [PIIRecord(n, i) for n, i in zip(NAMES, IDS, strict=True)]
    rows = budget_sweep(
        lm,
        method="scp-delta-r-b",
        pii=records,
        validation=VAL,
        options=BudgetOptions(
            budgets=(1.0, None), anchors=(0.0, 2.0), modes=("stop", "fallback", "anchor"),
            answer_tokens=4,
        ),
    )  # fmt: skip
    pii = {
        (r.extra["mode"], r.extra.get("anchor", r.extra["budget"]), r.metric): r
        for r in rows
        if r.metric in ("pii_ael", "pii_fer")
    }
    for setting in [("stop", 1.0), ("stop", None), ("fallback", 1.0), ("fallback", None),
                    ("anchor", 0.0), ("anchor", 2.0)]:  # fmt: skip
        for metric in ("pii_ael", "pii_fer"):
            r = pii[(*setting, metric)]
            assert r.n == len(records) and r.extra["ci_low"] <= r.value <= r.extra["ci_high"]
    assert pii[("fallback", None, "pii_ael")].value == pii[("stop", None, "pii_ael")].value
    mf = models.read_bundle(bundle)
    base = ProtectedLM.from_model(models.load_model(mf.resolve(bundle, mf.base)), lm.tokenizer)
    own = [extracted_chars(base.tokenizer, t, len(t.tokens)) for t in pii_traces(base, records)]
    assert pii[("anchor", 0.0, "pii_ael")].value == pytest.approx(np.mean(own))
