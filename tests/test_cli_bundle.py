"""`scpdr bundle --partitions DIR` audits the partitions like `scpdr train`: a passing audit is
recorded in the bundle, a failing one (a near-duplicate split across partitions) refuses with the
failed check and the fix and writes nothing unless --allow-failed-audit (recorded as overridden),
and the constituents must match the partitions in number (and a given manifest hash must agree)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from scpdr.cli import main
from scpdr.data.partition import (
    PartitionSet,
    audit_partitions,
    load_partitions,
    partition_records,
    save_partitions,
)
from scpdr.data.records import Record
from scpdr.models import BUNDLE_MANIFEST, read_bundle

_ALPHA = "abcdefghijklmnopqrstuvwxyz"


def _random_text(rng: random.Random, n_words: int = 40) -> str:
    return " ".join(
        "".join(rng.choice(_ALPHA) for _ in range(rng.randint(3, 9))) for _ in range(n_words)
    )


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Any]:
    """Two partition sets of 20 random texts in K=2 partitions: ``clean`` (as partitioned) and
    ``leaky`` (plus a one-word edit of a partition-0 record planted in partition 1)."""
    rng = random.Random(1)
    recs = [Record.make(id=f"r{i}", text=_random_text(rng)) for i in range(20)]
    pset = partition_records(recs, k=2, seed=0)
    root = tmp_path_factory.mktemp("parts")
    clean = save_partitions(root / "clean", pset)

    victim = pset.parts[0][3]
    words = victim.text.split()
    words[7] = "zzzz"
    near = Record.make(id="near", text=" ".join(words))
    manifest = pset.manifest.model_copy(deep=True)
    manifest.partitions[1].ids.append(near.id)
    manifest.partitions[1].hashes.append(near.hash)
    leaky_set = PartitionSet(manifest=manifest, parts=[pset.parts[0], [*pset.parts[1], near]])
    leaky = save_partitions(root / "leaky", leaky_set)
    return {"clean": clean, "leaky": leaky, "victim": victim.id}


def _argv(out: Path, tiny: Path, k: int = 2) -> list[str]:
    argv = ["bundle", str(out), "--base", str(tiny / "base")]
    for i in range(k):
        argv += ["-c", str(tiny / f"constituent-{i}")]
    return argv


def test_passing_audit_is_recorded(tmp_path, tiny, parts, capsys):
    pset = load_partitions(parts["clean"])
    digest = pset.manifest.sha256()
    out = tmp_path / "b"
    # the matching hash may be given as well
    argv = [*_argv(out, tiny), "--partitions", str(parts["clean"])]
    assert main([*argv, "--partition-manifest-hash", digest]) == 0
    manifest = read_bundle(out)
    assert manifest.partition_manifest_hash == digest
    expected = audit_partitions(pset.manifest, pset.records()).to_dict()
    assert manifest.audit == {**expected, "overridden": False}
    assert manifest.audit["passed"] is True and manifest.audit["k"] == 2
    assert manifest.audit["num_records"] == 20
    assert str(out) in capsys.readouterr().out


def test_failing_audit_refuses_and_writes_nothing(tmp_path, tiny, parts, capsys):
    out = tmp_path / "b"
    rc = main([*_argv(out, tiny), "--partitions", str(parts["leaky"])])
    err = capsys.readouterr().err
    assert rc != 0
    assert "partition audit FAILED" in err and "1 near-duplicate overlaps" in err
    assert "Failed checks: near duplicate overlaps." in err
    assert f"{parts['victim']} (partition 0) ~ near (partition 1)" in err
    assert "`scpdr partition`" in err and "--allow-failed-audit" in err
    assert not out.exists()


def test_allow_failed_audit_writes_the_override(tmp_path, tiny, parts):
    out = tmp_path / "b"
    argv = [*_argv(out, tiny), "--partitions", str(parts["leaky"]), "--allow-failed-audit"]
    assert main(argv) == 0
    manifest = read_bundle(out)
    audit = manifest.audit
    assert audit["passed"] is False and audit["overridden"] is True
    [o] = audit["near_duplicate_overlaps"]
    assert {o["id_a"], o["id_b"]} == {parts["victim"], "near"}
    assert {o["partition_a"], o["partition_b"]} == {0, 1}
    assert manifest.partition_manifest_hash == load_partitions(parts["leaky"]).manifest.sha256()


def test_constituent_count_must_match_partitions(tmp_path, tiny, parts, capsys):
    out = tmp_path / "b"
    assert main([*_argv(out, tiny, k=1), "--partitions", str(parts["clean"])]) == 2
    err = capsys.readouterr().err
    assert "1 constituents but" in err and "holds 2 partitions" in err
    assert "one --constituent per partition" in err
    assert not out.exists()


def test_disagreeing_manifest_hash_is_an_error(tmp_path, tiny, parts, capsys):
    out = tmp_path / "b"
    argv = [*_argv(out, tiny), "--partitions", str(parts["clean"])]
    assert main([*argv, "--partition-manifest-hash", "0" * 64]) == 2
    err = capsys.readouterr().err
    assert "disagrees with the hash of" in err
    assert load_partitions(parts["clean"]).manifest.sha256() in err
    assert not out.exists()


def test_hash_without_partitions_still_works_and_override_needs_partitions(tmp_path, tiny, capsys):
    out = tmp_path / "b"
    assert main([*_argv(out, tiny), "--partition-manifest-hash", "abc123"]) == 0
    manifest = read_bundle(out)
    assert manifest.partition_manifest_hash == "abc123" and manifest.audit is None

    out2 = tmp_path / "b2"
    assert main([*_argv(out2, tiny), "--allow-failed-audit"]) == 2
    assert "--allow-failed-audit needs --partitions" in capsys.readouterr().err
    assert not (out2 / BUNDLE_MANIFEST).exists()


def test_not_a_partition_directory(tmp_path, tiny, capsys):
    assert main([*_argv(tmp_path / "b", tiny), "--partitions", str(tmp_path)]) == 2
    assert "scpdr partition" in capsys.readouterr().err


def test_train_bundle_shares_the_audit(tmp_path, tiny, parts):
    """`scpdr train` (train_bundle) refuses the same leaky partitions, before any training."""
    from scpdr.errors import PartitionAuditError
    from scpdr.training import train_bundle

    with pytest.raises(PartitionAuditError, match="Failed checks: near duplicate overlaps"):
        train_bundle(
            load_partitions(parts["leaky"]), base=tiny / "base", config=None, out=tmp_path / "t"
        )
    assert not (tmp_path / "t" / BUNDLE_MANIFEST).exists()
    assert not (tmp_path / "t" / "constituent-0").exists()
