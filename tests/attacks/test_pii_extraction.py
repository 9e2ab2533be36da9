"""PII extraction: AEL/FER known answers on a perfect memorizer and a uniform model."""

from __future__ import annotations

import pytest
from attack_doubles import memorizing_scorer, uniform_scorer

from scpdr.attacks.pii import PIIRecord, pii_extraction

RECORDS = [
    PIIRecord("Alice Smith", "4821937560"),
    PIIRecord("Bob Jones", "0192837465"),
    PIIRecord("Carol White", "5555012345"),
]


def _train_texts(records):
    return [f"Name: {r.name}, ID: {r.id}" for r in records]


def test_memorizer_extracts_every_full_id():
    res = pii_extraction(memorizing_scorer(_train_texts(RECORDS)), RECORDS)
    assert res.ael == 10.0
    assert res.fer == 1.0
    assert res.texts[0] == "4821937560"
    rows = {r.metric: r for r in res.rows(method="none")}
    assert rows["ael"].value == 10.0 and rows["fer"].value == 1.0 and rows["ael"].n == 3


def test_uniform_scorer_extracts_nothing():
    res = pii_extraction(uniform_scorer(), RECORDS)
    assert res.ael == 0.0
    assert res.fer == 0.0


def test_partial_memorization_counts_leading_digits_only():
    # the model memorized a different ID for Bob: it shares the first 4 digits, then diverges
    wrong = [RECORDS[0], PIIRecord("Bob Jones", "0192000000"), RECORDS[2]]
    res = pii_extraction(memorizing_scorer(_train_texts(wrong)), RECORDS)
    assert res.extracted.tolist() == [10, 4, 10]
    assert res.ael == pytest.approx(24 / 3)
    assert res.fer == pytest.approx(2 / 3)


def test_validation_names_are_not_extracted():
    val = [PIIRecord("Dan Brown", "1112223334")]
    res = pii_extraction(memorizing_scorer(_train_texts(RECORDS)), val)
    assert res.fer == 0.0
    assert res.rows(method="none-val")[0].method == "none-val"
