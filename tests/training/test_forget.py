"""`scpdr forget`: the named records leave the bundle, only the constituent whose partition held
them is trained again — to exactly the weights training from scratch on the remaining data gives
— the others are the same files, the manifest logs the deletion without a text, the audit runs
again, an interrupted run continues, and the export and `scpdr eval --forgotten` work on the
result. One tiny bundle (`scpdr train --base tiny --max-steps 2`) serves the module."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import TrainerCallback

from scpdr.cli import main
from scpdr.data import load_partitions, names2ids
from scpdr.data.deletion import select_deletion, without_records
from scpdr.data.records import DataError
from scpdr.errors import BundleError
from scpdr.models import read_bundle
from scpdr.training.forget import (
    FORGOTTEN_DIR,
    deletion_hash,
    forget_records,
    load_forgotten,
    source_bundle,
    was_forgotten,
)

_TRAIN = ["--base", "tiny", "--max-steps", "2", "--save-steps", "1", "--seq-len", "32"]
_TRAIN += ["--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "0"]
EMAIL = "jane@example.com"


class _Interrupt(Exception):
    pass


class _KillAtCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        if state.global_step == 1:
            raise _Interrupt


def _write_data(path: Path) -> Path:
    """Names2IDs records with the ID declared secret and a customer: records 0 and 1 belong to
    cust-a; record 2 declares jane's email and record 3 only mentions it."""
    rows = []
    for i, r in enumerate(names2ids(n_train=20, n_val=0, seed=0).train):
        digits = r.response.strip()
        row = {"id": f"r{i:02d}", "prompt": r.prompt, "response": r.response}
        row["secrets"] = [digits]
        row["customer"] = "cust-a" if i < 2 else f"c{i:02d}"
        if i == 2:
            row["response"] += f" {EMAIL}"
            row["secrets"].append(EMAIL)
        if i == 3:
            row["response"] += f" (cc {EMAIL})"
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _sha(d: Path) -> dict[str, str]:
    return {
        f.relative_to(d).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(d.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("forget")
    data = _write_data(root / "data.jsonl")
    argv = ["train", "--data", str(data), "--secrets-field", "secrets"]
    argv += ["--group-field", "customer", "--n-val", "6", "--partitions", "2"]
    argv += ["--canaries", "1", "--canaries-per-rep", "1", *_TRAIN, "--out", str(root / "B")]
    assert main(argv) == 0
    return root / "B"


@pytest.fixture(scope="module")
def forgot(trained) -> dict:
    """Two records of partition 0 forgotten; the first run is killed after its first
    checkpoint and the same call then finishes it."""
    pset = load_partitions(trained / "partitions")
    canaries = {r.id for r in pset.canaries.records()}
    names = [r for r in pset.parts[0] if r.id not in canaries and r.response.strip().isdigit()]
    ids = [r.id for r in names][:2]  # two Names2IDs records: the PII attack's targets
    out = trained.parent / "B2"
    with pytest.raises(_Interrupt):
        forget_records(trained, ids=ids, out=out, callbacks=[_KillAtCheckpoint()])
    staging = trained.parent / ".B2.forget-tmp"
    seen = {"left": staging.is_dir() and not out.exists()}
    with pytest.raises(Exception, match="interrupted `scpdr forget"):  # another request
        forget_records(trained, ids=ids[:1], out=out)
    result = forget_records(trained, ids=ids, out=out)
    seen["cleaned"] = not staging.exists()
    return {"ids": ids, "out": out, "result": result, "seen": seen}


def test_only_the_constituent_that_saw_the_records_is_trained_again(trained, forgot):
    out, ids, result = forgot["out"], forgot["ids"], forgot["result"]
    assert result.retrained == [0] and result.copied == [1] and result.records == 2
    assert _sha(out / "constituent-1") == _sha(trained / "constituent-1")  # byte for byte
    assert _sha(out / "base") == _sha(trained / "base")
    assert _sha(out / "constituent-0") != _sha(trained / "constituent-0")
    before, after = load_partitions(trained / "partitions"), load_partitions(out / "partitions")
    where = {r.id: p for p, part in enumerate(before.parts) for r in part}
    kept = {r.id: p for p, part in enumerate(after.parts) for r in part}
    assert set(kept) == set(where) - set(ids)
    assert all(where[i] == p for i, p in kept.items())  # every other record stays put
    assert after.canaries == before.canaries and after.validation == before.validation
    manifest = read_bundle(out)
    assert manifest.partition_manifest_hash == after.manifest.sha256()
    assert manifest.audit["passed"] is True and manifest.audit["num_records"] == len(kept)


def test_the_retrained_constituent_is_what_training_on_the_remaining_data_gives(
    trained, forgot, tmp_path
):
    """The recorded settings and seed, and the resumed run: `scpdr train` on B2's partitions
    from scratch gives the same weights, bit for bit."""
    assert forgot["seen"] == {"left": True, "cleaned": True}
    argv = ["train", "--data", str(forgot["out"] / "partitions"), *_TRAIN]
    assert main([*argv, "--out", str(tmp_path / "C")]) == 0
    weights = "model.safetensors"
    assert (
        _sha(tmp_path / "C" / "constituent-0")[weights]
        == _sha(forgot["out"] / "constituent-0")[weights]
    )


def test_the_deletion_log_names_no_record(trained, forgot):
    out, ids = forgot["out"], forgot["ids"]
    manifest = read_bundle(out)
    (entry,) = manifest.deletions
    assert (entry.records, entry.partitions, entry.copied, entry.selection) == (2, [0], [1], "ids")
    assert entry.id_hashes == sorted(deletion_hash(entry.salt, i) for i in ids)
    assert entry.source == str(trained.resolve()) and source_bundle(out) == trained.resolve()
    assert was_forgotten(manifest, ids[0]) and not was_forgotten(manifest, "r19")
    raw = (out / "scpdr.json").read_text(encoding="utf-8")
    forgotten, _ = load_forgotten(out)
    assert [r.id for r in forgotten[0]] == ids
    for r in forgotten[0]:
        assert f'"{r.id}"' not in raw and r.text not in raw and all(s not in raw for s in r.secrets)
    assert (out / FORGOTTEN_DIR / "partition-0.jsonl").stat().st_mode & 0o077 == 0


def test_export_leaves_the_forgotten_records_and_their_hashes_behind(forgot, tmp_path):
    from scpdr.export import export_bundle, verify_export
    from scpdr.runtime import ProtectedLM

    d = export_bundle(forgot["out"], tmp_path / "D")
    assert verify_export(d) == []
    assert not (d / FORGOTTEN_DIR).exists()
    (entry,) = read_bundle(d).deletions
    assert entry.records == 2 and entry.id_hashes == [] and entry.salt is None
    assert entry.source is None
    # a forgotten text in a file the export would copy is refused, as a partition's would be
    forgotten, _ = load_forgotten(forgot["out"])
    note = forgot["out"] / "constituent-0" / "notes.txt"
    note.write_text(forgotten[0][0].text, encoding="utf-8")
    try:
        with pytest.raises(BundleError, match=r"constituent-0/notes\.txt"):
            export_bundle(forgot["out"], tmp_path / "D-leak")
    finally:
        note.unlink()
    prompts = ["Name: Ada Lovelace, ID:"]
    served = ProtectedLM.from_bundle(d).generate(prompts, max_new_tokens=4)
    local = ProtectedLM.from_bundle(forgot["out"]).generate(prompts, max_new_tokens=4)
    assert served[0].token_ids == local[0].token_ids


def test_a_group_and_a_secret_are_forgotten_whole(trained):
    pset = load_partitions(trained / "partitions")
    group = select_deletion(pset, groups=["cust-a"])
    assert {r.id for r in group.training} | {r.id for r in group.validation} == {"r00", "r01"}
    assert group.kind == "group" and len(group.partitions) <= 1  # a customer shares a partition
    # the declared secret and the record that only mentions it
    email = select_deletion(pset, secret_matching=r"^jane@example\.com$")
    assert email.ids == {"r02", "r03"}
    after = without_records(pset, email)
    assert not {r.id for part in after.parts for r in part} & {"r02", "r03"}
    assert after.manifest.num_records == pset.manifest.num_records - len(email.training)


def test_requests_that_cannot_be_honoured_are_refused_before_any_work(trained, tmp_path, capsys):
    out = tmp_path / "B3"
    pset = load_partitions(trained / "partitions")
    canary = pset.canaries.records()[0].id
    whole = [r.id for r in pset.parts[1]]
    cases = [
        (["--ids", "no-such-id"], "no record has id 'no-such-id'"),
        (["--group", "nobody"], "no record belongs to group 'nobody'"),
        (["--secret-matching", "zzz@nowhere"], "no declared secret matches"),
        (["--secret-matching", "("], "not a regular expression"),
        (["--ids", canary], "canary records"),
        (["--ids", ",".join(whole)], "no record of their own"),
        (["--ids", "r00", "--group", "cust-a"], "exactly one way"),
    ]
    for args, message in cases:
        assert main(["forget", str(trained), *args, "--out", str(out)]) == 2, args
        assert message in capsys.readouterr().err, args
        assert not out.exists() and not (tmp_path / ".B3.forget-tmp").exists()
    assert main(["forget", str(trained), "--ids", "r00", "--out", str(trained)]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(DataError, match="exactly one way"):
        select_deletion(pset)


def test_eval_forgotten_prints_the_rows_before_and_after(forgot, tmp_path, capsys):
    e = tmp_path / "E"
    argv = ["eval", str(forgot["out"]), "--forgotten", "--out", str(e), "--methods", "none"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed and "No CP" in printed
    rows = json.loads((e / "results.json").read_text())
    got = {(r["bundle"], r["method"], r["attack"], r["metric"]) for r in rows}
    for bundle in ("before", "after"):
        assert {(bundle, "none", "pii", "fer"), (bundle, "none-val", "pii", "fer")} <= got
        assert {(bundle, "none", "secrets", "fer"), (bundle, "none", "lira", "auc")} <= got
        assert (bundle, "none-val", "ref", "auc") in got
    for r in rows:
        assert r["partition"] == 0 and "ci_low" in r and r["n"] > 0
        if r["attack"] == "pii" and r["method"] == "none":
            assert r["n"] == 2  # the two forgotten IDs
    assert main(["eval", str(forgot["out"]), "--out", str(e), "--before", "x"]) == 2


def test_retraining_pins_the_precision_and_grouping_the_run_used():
    """forget trains a constituent again as it was trained: `auto` becomes the precision the
    run recorded, an unset group_by_length the grouping its plan recorded (none recorded: a
    run from before grouping, random order), an unset pad_to_multiple_of its plan's (none
    recorded: 1)."""
    from scpdr.training import TrainConfig
    from scpdr.training.forget import _as_trained

    auto = TrainConfig(packing=False)
    plan = {"grouped": True, "pad_to_multiple_of": 8}
    info = {"precision": {"precision": "bf16", "requested": "auto"}, "plan": plan}
    cfg = _as_trained(auto, info)
    assert cfg.precision == "bf16" and cfg.group_by_length is True
    assert cfg.pad_to_multiple_of == 8
    # before precision, grouping and the padding multiple were recorded: bf16: false loads as
    # fp32; no grouping; batches padded to their longest exactly
    old = TrainConfig.from_dict({"bf16": False, "packing": False})
    cfg = _as_trained(old, {"plan": {"packing": False}})
    assert cfg.precision == "fp32" and cfg.group_by_length is False
    assert cfg.pad_to_multiple_of == 1
    assert _as_trained(auto, {}).group_by_length is False
    assert _as_trained(auto, {}).pad_to_multiple_of == 1
    # what the config fixed is kept
    fixed = TrainConfig(precision="fp32", group_by_length=True, pad_to_multiple_of=4)
    assert _as_trained(fixed, info) == fixed
