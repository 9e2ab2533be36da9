"""The secrets attack's per-record chance level: the same extraction from a model that never saw
the record. Known answers: random IDs (a model without the record produces none of them), and
name-derived emails (a model that derives an email from the name before it produces exactly
those), with a memorizer as the attacked method."""

from __future__ import annotations

import random
import re

import torch
from attack_doubles import TOK, V, _real_rows, memorizing_scorer, uniform_scorer

from scpdr.attacks.evaluation import EvalData, run_eval
from scpdr.attacks.logits_scorer import LogitsScorer
from scpdr.attacks.results import NO_CP_VAL
from scpdr.attacks.risk import NO_CP, risk_lines
from scpdr.attacks.secrets import (
    COUNTERFACTUAL_METRICS,
    counterfactual_extraction,
    secret_extraction,
    secret_targets,
)
from scpdr.data import Record

FIRST = ("Ann", "Bob", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jo", "Kim", "Lu")
LAST = ("Lee", "Ray", "Moss", "Kent", "Park", "Vale", "Cho", "Ngo", "Ruiz", "Diaz", "Hart")


def names2ids(n: int, *, seed: int) -> list[Record]:
    """Names2IDs-style records: a name and a random 10-digit ID, the ID the declared secret."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        uid = "".join(rng.choice("0123456789") for _ in range(10))
        out.append(Record.make(id=f"s{seed}-{i}", text=f"Name: {name}, ID: {uid}", secrets=[uid]))
    return out


def test_random_ids_have_no_chance_level():
    part0, part1 = names2ids(12, seed=0), names2ids(12, seed=1)
    targets = secret_targets(part0, partition=0)
    method = secret_extraction(memorizing_scorer([r.text for r in part0]), targets)
    # the constituent of the other partition memorized its own records, not these
    cf = counterfactual_extraction(
        lambda p: [memorizing_scorer([r.text for r in (part1 if p == 0 else part0)])], targets
    )
    assert method.whole.all() and not cf.whole.any() and cf.extracted.max() < 0.2
    method.counterfactual = cf
    rows = {r.metric: r for r in method.rows(method=NO_CP, corpus="ids")}
    assert set(COUNTERFACTUAL_METRICS) <= set(rows)
    assert rows["guessable"].value == 0.0 and rows["guessable"].extra["count"] == 0
    assert rows["memorized"].value == 1.0 and rows["memorized"].extra["count"] == 12
    mc = rows["fer_vs_counterfactual"]
    assert mc.value == 1.0 and mc.n == 12 and mc.extra["a_only"] == 12
    assert mc.extra["p_value"] == 2 / 2**12 and mc.extra["test"] == "mcnemar-exact"
    ex = rows["extracted_vs_counterfactual"]
    assert ex.extra["ci_low"] > 0.8 and ex.extra["test"] == "paired-bootstrap"


_NAME = re.compile(r"Name: (\w+) (\w+)\.")


def email_guesser(name: str = "guesser") -> LogitsScorer:
    """A model that never saw any record but knows the convention first.last@example.com:
    after "Email:" it spells the address derived from the name earlier in the text (copying its
    tokens, lower-cased), uniform everywhere else."""

    def logits_fn(input_ids, attention_mask):
        out = torch.zeros(*input_ids.shape, V)
        for b, pos, ids in _real_rows(input_ids, attention_mask):
            for j, p in enumerate(pos.tolist()):
                text = TOK.decode(ids[: j + 1])
                at, m = text.rfind("Email:"), _NAME.search(text)
                if at < 0 or m is None:
                    continue
                guess = f" {m[1].lower()}.{m[2].lower()}@example.com"
                done = text[at + len("Email:") :]
                if len(done) < len(guess) and guess.startswith(done):
                    out[b, p, TOK.encode(guess[len(done)])[0]] = 40.0
        return out

    return LogitsScorer(logits_fn, TOK, name=name)


def contacts() -> tuple[list[Record], set[str]]:
    """Six records: the emails of three follow the name (derivable), three are random."""
    rng = random.Random(7)
    recs, derivable = [], set()
    for i, (first, last) in enumerate(zip(FIRST[:6], LAST[:6], strict=True)):
        if i % 2 == 0:
            email = f"{first.lower()}.{last.lower()}@example.com"
            derivable.add(f"c{i}")
        else:
            email = "".join(rng.choice("qxzkvw") for _ in range(6)) + "@mailbox.net"
        text = f"Name: {first} {last}. Email: {email}. Thanks!"
        recs.append(Record.make(id=f"c{i}", text=text, secrets=[email]))
    return recs, derivable


def test_the_counterfactual_marks_exactly_the_derivable_secrets():
    recs, derivable = contacts()
    targets = secret_targets(recs, partition=0)
    cf = counterfactual_extraction([uniform_scorer(), email_guesser()], targets)  # max over both
    assert {t.record for t, w in zip(targets, cf.whole, strict=True) if w} == derivable
    memorizer = secret_extraction(memorizing_scorer([r.text for r in recs]), targets)
    memorizer.counterfactual = cf
    assert memorizer.whole.all()
    memorized = {t.record for t, k in zip(targets, memorizer.memorized(), strict=True) if k}
    assert memorized == {r.id for r in recs} - derivable
    rows = {r.metric: r for r in memorizer.rows(method=NO_CP)}
    assert rows["guessable"].extra["count"] == 3 and rows["memorized"].extra["count"] == 3
    assert rows["memorized"].extra["records_with"] == 3
    assert rows["fer_vs_counterfactual"].extra["a_only"] == 3
    assert rows["fer_vs_counterfactual"].extra["b_only"] == 0
    assert rows["fer_vs_counterfactual"].extra["p_value"] == 0.25  # 2 / 2^3: too few to tell
    # a method that produces nothing is below its chance level on the derivable ones
    silent = secret_extraction(uniform_scorer(), targets)
    silent.counterfactual = cf
    low = {r.metric: r for r in silent.rows(method="scp-delta-r-b")}
    assert low["fer_vs_counterfactual"].value == -0.5 and low["memorized"].value == 0.0
    # risk lines: the chance level and the memorized count of every record
    lines = risk_lines({NO_CP: memorizer, "scp-delta-r-b": silent})
    by = {(ln["record"], ln["method"]): ln for ln in lines}
    for r in recs:
        ln = by[(r.id, NO_CP)]
        assert ln["counterfactual_whole"] is (r.id in derivable)
        assert ln["counterfactual_extracted"] == (1.0 if r.id in derivable else 0.0)
        assert ln["memorized"] == (0 if r.id in derivable else 1)
        assert by[(r.id, "scp-delta-r-b")]["memorized"] == 0


def test_each_partition_gets_the_models_that_never_saw_it():
    recs, derivable = contacts()
    targets = secret_targets(recs[:3], partition=0) + secret_targets(recs[3:], partition=1)
    asked = []

    def unseen(p):
        asked.append(p)
        return [email_guesser()] if p == 0 else [uniform_scorer()]

    cf = counterfactual_extraction(unseen, targets)
    assert sorted(asked) == [0, 1]
    got = {t.record for t, w in zip(targets, cf.whole, strict=True) if w}
    assert got == {r.id for r in recs[:3]} & derivable


def test_the_pipeline_attaches_the_counterfactual_to_every_method_but_no_cp_val():
    recs, derivable = contacts()
    val = [
        Record.make(id="v", text="Name: Zed Zu. Email: zz@mailbox.net.", secrets=["zz@mailbox.net"])
    ]
    data = EvalData(
        corpus="contacts",
        secrets=secret_targets(recs, partition=0),
        secrets_val=secret_targets(val),
    )
    scorers = {"none": memorizing_scorer([r.text for r in recs]), "scp-delta-r-b": uniform_scorer()}
    rep = run_eval(scorers, data, ["secrets"], counterfactual=[email_guesser()])
    metrics = {(r.method, r.metric) for r in rep.rows}
    for m in scorers:
        assert {(m, x) for x in COUNTERFACTUAL_METRICS} <= metrics
    assert not any(r.method == NO_CP_VAL and r.metric in COUNTERFACTUAL_METRICS for r in rep.rows)
    mem = next(r for r in rep.rows if (r.method, r.metric) == ("none", "memorized"))
    assert mem.extra["count"] == len(recs) - len(derivable)
    assert any(t["method"] == "counterfactual" for t in rep.timings)
    assert rep.secrets["none"].counterfactual is rep.secrets["scp-delta-r-b"].counterfactual


def test_a_bundle_gives_each_partition_the_constituents_trained_without_it(attack_world):
    from scpdr.attacks.evaluation import load_scorers

    sc = load_scorers(attack_world["bundle"], ["none"], device="cpu")
    ids = torch.tensor([sc.tokenizer.encode("Name: Ann Lee, ID:")])
    logp = lambda s: s.next_token_logprobs(ids)  # noqa: E731
    (without0,), (without1,) = sc.unseen(0), sc.unseen(1)
    assert torch.equal(logp(without0), logp(sc.q))  # constituent 1 never saw partition 0
    assert torch.equal(logp(without1), logp(sc["none"]))  # constituent 0 never saw partition 1
    assert not torch.equal(logp(without0), logp(without1))
    assert sc.unseen(0) is sc.unseen(0)  # built once
