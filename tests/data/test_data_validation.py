"""The validation split: carved by whole groups (near-duplicates, data subjects, shared declared
secrets), large enough for a TPR at 1% FPR when the data allows, audited against the partitions
(an overlap fails, forced through it is named and recorded), and left out of the attacks'
non-members."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from scpdr.attacks.eval_data import EvalData
from scpdr.cli import main
from scpdr.data import (
    FieldMapping,
    GroupingConfig,
    Record,
    SecretsConfig,
    build_corpus,
    load_corpus,
    load_partitions,
    partition_records,
    prepare_partitions,
)
from scpdr.data.audit import audit_partitions
from scpdr.data.grouping import near_duplicate_pairs
from scpdr.data.user_data import default_val_size
from scpdr.errors import PartitionAuditError

_WORDS = "amber basil cedar delta ember fjord garnet harbor iris juniper kelp lotus".split()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _sentence(rng: random.Random, n: int = 8) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 8)))
        for _ in range(n)
    )


def _pairs_file(tmp_path: Path, n_pairs: int = 40) -> Path:
    """The reported case: ``n_pairs`` records and the same with "approved the" (near-duplicates
    of each other, unlike any other pair)."""
    rng = random.Random(27)
    rows = []
    for i in range(n_pairs):
        tail = _sentence(rng)
        rows.append({"id": f"p{i}a", "text": f"Record {i}: the board approved {tail}."})
        rows.append({"id": f"p{i}b", "text": f"Record {i}: the board approved the {tail}."})
    return _write(tmp_path / "pairs.jsonl", rows)


@pytest.mark.parametrize("val_fraction", [0.1, None, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_near_duplicate_pairs_are_held_out_whole(tmp_path, seed, val_fraction):
    src = _pairs_file(tmp_path)
    data = prepare_partitions(src, k=2, seed=seed, val_fraction=val_fraction)
    where: dict[str, str] = {r.id: "validation" for r in data.pset.validation}
    for p, part in enumerate(data.pset.parts):
        where.update({r.id: f"partition {p}" for r in part})
    assert len(where) == 80 and data.pset.validation
    for i in range(40):
        assert where[f"p{i}a"] == where[f"p{i}b"], f"pair {i} split: {where[f'p{i}a']} / ..."
    assert data.audit.passed and data.audit.num_validation == len(data.pset.validation)
    # the same grouping as the partitions: 40 groups in all, 8 / 20 / 24 records held out
    expected = {0.1: 8, None: 20, 0.3: 24}[val_fraction]
    assert len(data.pset.validation) == expected


@pytest.mark.parametrize("seed", range(6))
def test_a_shared_declared_secret_never_straddles_validation_and_training(tmp_path, seed):
    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "text": f"Ticket {i}: {_sentence(rng)}."} for i in range(30)]
    # r0..r3 share an email (declared in r0, only mentioned elsewhere); r10/r11 share an
    # account number found by --secret-pattern only
    for i in range(4):
        rows[i]["text"] += " Reply to jane.doe@corp.example today."
    rows[0]["secrets"] = ["jane.doe@corp.example"]
    rows[10]["text"] += " Account 4821937560."
    rows[11]["text"] += " Same account 4821937560 again."
    src = _write(tmp_path / "s.jsonl", rows)
    data = prepare_partitions(
        src,
        k=2,
        seed=seed,
        val_fraction=0.4,
        fields=FieldMapping(secrets="secrets"),
        secrets=SecretsConfig(patterns=(r"\b\d{10}\b",)),
    )
    val = {r.id for r in data.pset.validation}
    assert 8 <= len(val) <= 12
    for holders in ({"r0", "r1", "r2", "r3"}, {"r10", "r11"}):
        assert holders <= val or not holders & val, (holders, val)
    assert data.audit.passed and not data.audit.validation_overlaps


@pytest.mark.parametrize("seed", range(4))
def test_a_group_field_group_is_never_split(tmp_path, seed):
    rng = random.Random(100 + seed)
    sizes = [1, 1, 2, 3, 5, 1, 4, 2, 1, 6, 2, 3]
    rows = [
        {"text": f"{c} note {j}: {_sentence(rng)}", "customer": f"c{c}"}
        for c, n in enumerate(sizes)
        for j in range(n)
    ]
    # a near-copy of a c3 record filed under c9: customers 3 and 9 are held out together
    rows.append({"text": rows[5]["text"] + " (resent)", "customer": "c9"})
    src = _write(tmp_path / "g.jsonl", rows)
    data = prepare_partitions(
        src, k=2, seed=seed, val_fraction=0.3, fields=FieldMapping(group="customer")
    )
    val_groups = {r.group for r in data.pset.validation}
    train_groups = {r.group for r in data.pset.records()}
    assert val_groups and not val_groups & train_groups
    assert ("c3" in val_groups) == ("c9" in val_groups)


def test_default_carve_size_and_the_few_nonmembers_warning(tmp_path, caplog):
    # max(10%, min(100, 25%)): at least 100 once there are 400 records, never over 25%
    assert [default_val_size(n) for n in (10, 80, 100, 400, 1000, 2000)] == [
        2,
        20,
        25,
        100,
        100,
        200,
    ]
    rng = random.Random(5)
    rows = [{"text": f"Entry {i}: {_sentence(rng)}"} for i in range(400)]
    src = _write(tmp_path / "big.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        corpus = load_corpus(src, val_fraction=None)
    assert len(corpus.validation) == 100 and "TPR@1%" not in caplog.text
    assert corpus.meta["validation"]["rule"].startswith("max(10%")
    with caplog.at_level(logging.WARNING):
        small = load_corpus(src, val_fraction=0.1)
    assert len(small.validation) == 40
    assert "TPR@1% cannot be resolved with 40 non-members" in caplog.text


def test_built_in_corpora_carve_validation_by_near_duplicate_group():
    # pydocs at its default sizes holds near-copies (a stdlib docstring and its copy elsewhere):
    # none straddles the splits, and the sizes are the requested ones
    c = build_corpus("pydocs", n_train=900, n_val=100, seed=0)
    assert len(c.train) == 900 and len(c.validation) == 100
    texts = [r.text for r in c.train] + [r.text for r in c.validation]
    pairs = near_duplicate_pairs(texts, GroupingConfig())
    assert pairs  # the corpus has near-duplicates: the check below is not vacuous
    assert not [(i, j) for i, j, _ in pairs if i < 900 <= j]


def _contaminated_dataset(tmp_path: Path) -> Path:
    """A datasets dir whose own validation split holds a copy, a near-copy and a record sharing
    a declared secret with the training split, and two clean records."""
    import datasets

    rng = random.Random(9)
    train = [{"key": f"t{i}", "text": f"Note {i}: {_sentence(rng, 10)}."} for i in range(12)]
    train[4]["text"] += " Contact vault.key@bank.example now."
    train[4]["secrets"] = ["vault.key@bank.example"]
    for r in train:
        r.setdefault("secrets", [])
    val = [
        {"key": "v-copy", "text": train[0]["text"], "secrets": []},
        {"key": "v-near", "text": "Fwd: " + train[1]["text"], "secrets": []},
        {"key": "v-secret", "text": "Unrelated: forward to vault.key@bank.example.", "secrets": []},
        {"key": "v-ok1", "text": f"Fresh: {_sentence(rng, 10)}.", "secrets": []},
        {"key": "v-ok2", "text": f"Other: {_sentence(rng, 10)}.", "secrets": []},
    ]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list(val)}
    )
    dd.save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_the_audit_fails_on_validation_overlaps_and_names_them_when_forced(tmp_path, capsys):
    src = _contaminated_dataset(tmp_path)
    fields = FieldMapping(id="key", secrets="secrets")
    with pytest.raises(PartitionAuditError) as err:
        prepare_partitions(src, k=2, fields=fields, out=tmp_path / "p")
    msg = str(err.value)
    assert "validation overlaps" in msg and "no non-member" in msg
    for vid in ("v-copy", "v-near", "v-secret"):
        assert vid in msg
    assert "vault.key@bank.example" not in msg and not (tmp_path / "p").exists()

    forced = prepare_partitions(
        src, k=2, fields=fields, out=tmp_path / "p", allow_failed_audit=True
    )
    audit = forced.audit
    assert not audit.passed and forced.overridden
    assert audit.contaminated_validation == ["v-copy", "v-near", "v-secret"]
    kinds = {o.validation_id: o.kind for o in audit.validation_overlaps}
    assert kinds == {"v-copy": "exact", "v-near": "near", "v-secret": "secret"}
    by_kind = {o.kind: o for o in audit.validation_overlaps}
    assert by_kind["exact"].record_id == "t0" and by_kind["near"].record_id == "t1"
    assert by_kind["secret"].record_id == "t4"
    record = forced.audit_record()
    assert (
        record["overridden"] and record["contaminated_validation"] == audit.contaminated_validation
    )
    assert "vault.key@bank.example" not in json.dumps(record)
    saved = load_partitions(tmp_path / "p")
    assert saved.contaminated_validation == ["v-copy", "v-near", "v-secret"]
    assert [r.id for r in saved.clean_validation()] == ["v-ok1", "v-ok2"]

    # `scpdr audit-partitions` re-checks the directory: exit 1, the overlaps named
    capsys.readouterr()
    assert main(["audit-partitions", str(tmp_path / "p"), "--json", str(tmp_path / "a.json")]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "3 overlapping the partitions" in out
    assert "'v-near' is a near-duplicate" in out and "vault.key@bank.example" not in out
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["contaminated_validation"] == ["v-copy", "v-near", "v-secret"]


def test_hand_built_partitions_with_a_validation_copy_fail_the_audit():
    rng = random.Random(3)
    recs = [Record.make(id=f"r{i}", text=f"Row {i}: {_sentence(rng, 10)}.") for i in range(10)]
    val = [Record.make(id="v0", text=recs[3].text), Record.make(id="v1", text="fresh text here")]
    pset = partition_records(recs, k=2, validation=val)
    report = audit_partitions(pset.manifest, pset.records(), validation=pset.validation)
    assert not report.passed and report.contaminated_validation == ["v0"]
    assert "validation record 'v0' is the same text as 'r3'" in report.summary()
    clean = audit_partitions(pset.manifest, pset.records(), validation=val[1:])
    assert clean.passed and clean.num_validation == 1


def test_eval_nonmembers_leave_out_the_flagged_validation_records(tmp_path, caplog):
    src = _contaminated_dataset(tmp_path)
    fields = FieldMapping(id="key", secrets="secrets")
    prepare_partitions(src, k=2, fields=fields, out=tmp_path / "p", allow_failed_audit=True)
    with caplog.at_level(logging.WARNING):
        data = EvalData.from_partitions(tmp_path / "p")
    assert "left 3 of 5 validation records out of the non-members" in caplog.text
    assert [r.id for r in data.nonmembers] == ["v-ok1", "v-ok2"]
    assert len(data.validation) == 2 and data.secrets_val == []
    with caplog.at_level(logging.WARNING):
        pop = data.mia_population("records")
    assert {r.id for r in pop.nonmembers} | {r.id for r in pop.null} <= {"v-ok1", "v-ok2"}
    assert "TPR@1% cannot be resolved with" in caplog.text
