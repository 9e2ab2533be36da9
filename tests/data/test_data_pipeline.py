"""prepare_partitions, the one data preparation (load → canaries → audited partitions → save):
the same partitions from a source name, a loaded Corpus and `scpdr partition`; canaries seeded by
the data's seed unless told; a failing audit refuses and writes nothing unless overridden (and the
override is recorded); the one CanaryConfig and FieldMapping read the experiment configs' YAML
sections; a user file's validation and training records are seeded random draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scpdr.cli import main
from scpdr.data import (
    CanaryConfig,
    FieldMapping,
    GroupingConfig,
    PreparedPartitions,
    load_corpus,
    load_partitions,
    prepare_partitions,
)
from scpdr.data.records import DataError
from scpdr.errors import PartitionAuditError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _qa_file(tmp_path: Path, n: int = 24) -> Path:
    src = tmp_path / "qa.jsonl"
    rows = [
        {"key": f"q{i}", "question": f"question {i} about topic {i * 7}?", "answer": f" {i}"}
        for i in range(n)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return src


def test_source_corpus_and_cli_give_the_same_partitions(tmp_path):
    src = _qa_file(tmp_path)
    fields = FieldMapping(prompt="question", response="answer", id="key")
    canaries = CanaryConfig(n_per_repetition=1, repetitions=(2,), partition=1)
    common = dict(k=3, seed=4, canaries=canaries, grouping=GroupingConfig(num_perm=64))
    a = prepare_partitions(src, n_val=4, fields=fields, out=tmp_path / "a", **common)
    assert isinstance(a, PreparedPartitions) and a.path == tmp_path / "a"
    corpus = load_corpus(src, n_val=4, seed=4, fields=fields)
    b = prepare_partitions(corpus, **common)
    assert b.path is None and b.pset.manifest == a.pset.manifest
    assert load_partitions(a.path).manifest == a.pset.manifest
    assert a.audit.passed and not a.overridden
    assert a.audit_record() == {**a.audit.to_dict(), "overridden": False}
    # the records are the file's, mapped; the canaries went to partition 1, seeded by the data
    ids = {r.id for r in a.pset.records()}
    assert {f"q{i}" for i in range(24)} - {r.id for r in a.pset.validation} <= ids
    assert a.pset.canaries.config.seed == 4 and a.pset.canaries.partition == 1
    assert a.pset.manifest.dataset["name"] == "qa" and a.pset.manifest.dataset["seed"] == 4
    # `scpdr partition` with the same options writes the same manifest
    argv = ["partition", str(src), "--k", "3", "--seed", "4", "--n-val", "4", "--out"]
    argv += [str(tmp_path / "c"), "--prompt-field", "question", "--response-field", "answer"]
    argv += ["--id-field", "key", "--num-perm", "64", "--canaries", "2"]
    argv += ["--canaries-per-rep", "1", "--canary-partition", "1"]
    assert main(argv) == 0
    assert load_partitions(tmp_path / "c").manifest == a.pset.manifest
    # an explicit canary seed is kept
    c = prepare_partitions(corpus, k=2, seed=4, canaries=canaries.model_copy(update={"seed": 9}))
    assert c.pset.canaries.config.seed == 9


def test_existing_out_is_refused_before_the_work(tmp_path):
    (tmp_path / "p").mkdir()
    with pytest.raises(DataError, match="already exists"):
        prepare_partitions("no-such-corpus", k=2, out=tmp_path / "p")
    done = prepare_partitions("names2ids", k=2, n_train=8, n_val=2, out=tmp_path / "p2")
    again = prepare_partitions(
        "names2ids", k=2, n_train=8, n_val=2, seed=1, out=done.path, overwrite=True
    )
    assert load_partitions(done.path).manifest == again.pset.manifest


def test_a_failing_audit_refuses_and_writes_nothing_unless_overridden(tmp_path):
    # a canary identical to a training record: the held-out canary appears in the training data
    probe = prepare_partitions("names2ids", k=2, n_train=8, n_val=2, canaries=CanaryConfig())
    leaked = probe.pset.canaries.held_out[0].text
    src = tmp_path / "d.jsonl"
    rows = [{"text": f"record {i} on subject {i * 13} and more"} for i in range(8)]
    rows.append({"text": leaked})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(PartitionAuditError, match=r"canary errors.*my override"):
        prepare_partitions(
            src, k=2, canaries=CanaryConfig(), out=tmp_path / "p", override="my override"
        )
    assert not (tmp_path / "p").exists()
    ok = prepare_partitions(
        src, k=2, canaries=CanaryConfig(), out=tmp_path / "p", allow_failed_audit=True
    )
    assert not ok.audit.passed and ok.overridden and ok.audit_record()["overridden"] is True
    assert any("held-out canary" in e for e in ok.audit.canary_errors)
    assert (tmp_path / "p" / "manifest.json").is_file()


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.name)
def test_experiment_yaml_sections_are_the_data_configs(path):
    """Every `canaries:` and `fields:` section of the shipped experiment configs validates as
    the one CanaryConfig / FieldMapping (what the experiment's schema can use directly)."""
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    for corpus in cfg.get("corpora") or []:
        if corpus.get("canaries") is not None:
            can = CanaryConfig.model_validate(corpus["canaries"])
            assert list(can.repetitions) == corpus["canaries"]["repetitions"]
        FieldMapping.model_validate(corpus.get("fields") or {})


def test_user_file_validation_and_training_records_are_seeded_random_draws(tmp_path, caplog):
    src = _qa_file(tmp_path, n=40)
    fields = {"prompt": "question", "response": "answer", "id": "key"}
    a = load_corpus(src, n_train=10, n_val=5, seed=0, fields=fields)
    b = load_corpus(src, n_train=10, n_val=5, seed=1, fields=fields)
    assert len(a.train) == 10 and len(a.validation) == 5
    assert {r.id for r in a.train} != {r.id for r in b.train}  # not the file's first ten
    assert not {r.id for r in a.train} & {r.id for r in a.validation}
    order = [f"q{i}" for i in range(40)]
    assert [r.id for r in a.train] == sorted((r.id for r in a.train), key=order.index)
    assert load_corpus(src, n_train=10, n_val=5, seed=0, fields=fields) == a
    everything = load_corpus(src, n_val=5, seed=0, fields=fields)  # n_train unset: all the rest
    assert len(everything.train) == 35 and everything.validation == a.validation
    with caplog.at_level("WARNING"):
        assert len(load_corpus(src, n_train=50, n_val=5, fields=fields).train) == 35
    assert "only 35 training records" in caplog.text
