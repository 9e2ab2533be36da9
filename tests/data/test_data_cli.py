"""`scpdr partition` and `scpdr audit-partitions`: help, a clean run, and a planted overlap."""

from __future__ import annotations

import json
from pathlib import Path

from scpdr.cli import main
from scpdr.data.partition import load_partitions
from scpdr.data.records import Record, save_records


def test_help():
    assert main(["partition", "--help"]) == 0
    assert main(["audit-partitions", "--help"]) == 0


def test_partition_then_audit_then_planted_overlap(tmp_path: Path, capsys):
    out = tmp_path / "parts"
    argv = ["partition", "names2ids", "--k", "3", "--out", str(out), "--n-train", "30"]
    argv += ["--n-val", "3", "--canaries", "1,3", "--canaries-per-rep", "2"]
    assert main(argv) == 0
    pset = load_partitions(out)
    assert pset.k == 3 and len(pset.validation) == 3 and pset.canaries is not None
    assert sum(len(p) for p in pset.parts) == 30 + 2 * (1 + 3)
    assert main(["audit-partitions", str(out), "--json", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["passed"] is True
    assert "PASSED" in capsys.readouterr().out

    # plant a copy of a partition-0 record into partition 1 (new id, same text) → exit 1
    victim = pset.parts[0][0]
    leaked = Record.make(id="leaked", prompt=victim.prompt, response=victim.response)
    save_records(out / "partition-1.jsonl", [*pset.parts[1], leaked])
    m = pset.manifest.model_copy(deep=True)
    m.partitions[1].ids.append(leaked.id)
    m.partitions[1].hashes.append(leaked.hash)
    m.save(out / "manifest.json")
    assert main(["audit-partitions", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "leaked" in text


def test_partition_user_file_with_field_mapping(tmp_path: Path):
    src = tmp_path / "qa.jsonl"
    rows = [{"q": f"question {i} about topic {i * 7}?", "a": f" answer {i}"} for i in range(10)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "p"
    argv = ["partition", str(src), "--k", "2", "--out", str(out)]
    assert main([*argv, "--prompt-field", "q", "--response-field", "a"]) == 0
    pset = load_partitions(out)
    # a file has no validation split: the default carve, max(10%, min(100, 25%)), holds out
    # two records of 10
    assert len(pset.validation) == 2 and pset.manifest.dataset["validation"]["source"] == "carved"
    kept = [r.prompt for p in pset.parts for r in p] + [r.prompt for r in pset.validation]
    assert sorted(kept) == sorted(r["q"] for r in rows)
    # the older --field OURS=THEIRS spelling still works and gives the same partitions
    old = tmp_path / "old"
    assert main([*argv[:-1], str(old), "--field", "prompt=q", "--field", "response=a"]) == 0
    assert load_partitions(old).manifest == pset.manifest
    assert main([*argv[:-1], str(tmp_path / "q"), "--field", "bad"]) == 2  # usage error
    assert main(["audit-partitions", str(tmp_path / "missing")]) == 2


def test_a_missing_text_column_names_the_options_train_has(tmp_path: Path, capsys):
    """The error used to suggest --field, which `scpdr train` does not have."""
    src = tmp_path / "qa.jsonl"
    src.write_text('{"q": "question?", "a": " answer"}\n' * 3, encoding="utf-8")
    train = ["train", "--data", str(src), "--base", "tiny", "--out", str(tmp_path / "t")]
    partition = ["partition", str(src), "--out", str(tmp_path / "p")]
    for argv in (train, partition):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--prompt-field COLUMN --response-field COLUMN" in err and "--text-field" in err
        assert "--field " not in err and not Path(argv[-1]).exists()
