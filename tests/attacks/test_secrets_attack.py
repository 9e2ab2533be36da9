"""Secret extraction and the risk report: known answers on a perfect memorizer, a memorizer of
half a secret, and a uniform model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from attack_doubles import memorizing_scorer, uniform_scorer

from scpdr.attacks.risk import NO_CP, risk_lines, save_risk
from scpdr.attacks.secrets import SECRETS_ATTACK, secret_extraction, secret_targets
from scpdr.data import Record

RECORDS = [
    Record.make(
        id="a",
        text="Ticket from Ann: mail ann@example.org about account 4821937560 today.",
        secrets=["ann@example.org", "4821937560"],
    ),
    Record.make(
        id="b", text="Bob asks for a refund to bob@example.net now.", secrets=["bob@example.net"]
    ),
    Record.make(id="c", text="No secret in this one."),
]


def test_targets_are_the_text_before_each_secret():
    targets = secret_targets(RECORDS, partition=0)
    assert [(t.record, t.index) for t in targets] == [("a", 0), ("a", 1), ("b", 0)]
    t = targets[0]
    assert t.prompt == "Ticket from Ann: mail" and t.lead == " " and t.secret == "ann@example.org"
    assert t.prompt + t.lead + t.secret in t.text and t.partition == 0
    # a secret at the very start of its record has no prefix to query with
    first = Record.make(id="d", text="4821937560 is my account", secrets=["4821937560"])
    assert secret_targets([first]) == []


def test_a_memorizer_gives_every_secret_whole_and_a_uniform_model_none():
    targets = secret_targets(RECORDS)
    mem = secret_extraction(memorizing_scorer([r.text for r in RECORDS]), targets, batch_size=2)
    assert mem.extracted.tolist() == [1.0, 1.0, 1.0] and mem.whole.all()
    uni = secret_extraction(uniform_scorer(), targets)
    assert not uni.whole.any() and uni.extracted.max() < 0.5
    rows = {r.metric: r for r in mem.rows(method="none", corpus="t")}
    assert set(rows) == {"extracted", "fer"} and rows["fer"].value == 1.0
    assert all(r.attack == SECRETS_ATTACK and r.n == 3 for r in rows.values())
    assert {"ci_low", "ci_high"} <= set(rows["extracted"].to_dict())


def test_extracted_counts_the_leading_characters_up_to_the_first_error():
    # the model memorized a text in which the account number differs from its 6th digit on
    other = "Ticket from Ann: mail ann@example.org about account 4821900000 today."
    res = secret_extraction(memorizing_scorer([other]), secret_targets(RECORDS[:1]))
    assert res.extracted[0] == 1.0  # the email
    assert res.extracted[1] == pytest.approx(5 / 10) and not res.whole[1]
    per = res.per_record()["a"]
    assert per["extracted"] == 1.0 and per["whole"] and per["secrets_whole"] == 1


def test_risk_lines_put_the_records_most_at_risk_under_no_cp_first(tmp_path):
    targets = secret_targets(RECORDS, partition=0)
    # No CP memorized record b only; the protected method nothing
    none = secret_extraction(memorizing_scorer([RECORDS[1].text]), targets)
    none.ref = {"a": 0.5, "b": 3.0}
    prot = secret_extraction(uniform_scorer(), targets)
    prot.ref = {"a": 0.1, "b": 0.2}
    lines = risk_lines({"scp-delta-r-b": prot, NO_CP: none})
    assert [ln["record"] for ln in lines] == ["b", "b", "a", "a"]
    assert [ln["method"] for ln in lines[:2]] == [NO_CP, "scp-delta-r-b"]  # table order
    assert lines[0]["extracted"] == 1.0 and lines[0]["whole"] and lines[0]["ref"] == 3.0
    assert lines[1]["extracted"] < 1.0 and lines[1]["rank"] == 1 and lines[2]["rank"] == 2
    assert all({"record", "partition", "method", "extracted"} <= set(ln) for ln in lines)
    path = save_risk(tmp_path / "risk.jsonl", lines)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines
    # the secrets themselves are never in the report
    assert not any(s in path.read_text() for r in RECORDS for s in r.secrets)


def test_no_targets_give_empty_results():
    res = secret_extraction(uniform_scorer(), [])
    assert res.extracted.size == 0 and np.isnan(res.rows()[0].value)
