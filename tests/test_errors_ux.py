"""Small user-facing errors: each names the problem and what the user can do, as one line on the
CLI (exit 2), never a traceback or a message about a hidden temp file."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from scpdr.cli import main
from scpdr.errors import BundleError, ConfigError


@pytest.fixture(scope="module")
def parts_without_canaries(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parts") / "p"
    argv = ["partition", "names2ids", "--out", str(out), "--n-train", "8", "--n-val", "2"]
    assert main([*argv, "--k", "2", "--canaries", ""]) == 0
    assert not (out / "canaries.json").exists()
    return out


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------- 1. config is a dir


def test_config_that_is_a_directory_says_so(tmp_path, capsys):
    from scpdr.experiment import load_config

    with pytest.raises(ConfigError, match="is a directory") as info:
        load_config(tmp_path)
    msg = str(info.value)
    assert "does not exist" not in msg
    assert "YAML" in msg and "configs/demo.yaml" in msg

    assert main(["experiment", str(tmp_path), "--dry-run"]) == 2
    (line,) = _error_lines(capsys)
    assert "is a directory" in line and "configs/demo.yaml" in line


# ----------------------------------------------------------------------------- 2. corrupt weights


def _writable_copy(bundle: Path, dst: Path) -> Path:
    """A copy of the session's read-only bundle whose files the test may damage."""
    return Path(shutil.copytree(bundle, dst, copy_function=shutil.copyfile))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_is_a_bundle_error_naming_the_file(tiny_bundle, tmp_path, damage):
    from safetensors import SafetensorError

    from scpdr.models import load_model

    bundle = _writable_copy(tiny_bundle, tmp_path / "b")
    weights = bundle / "constituent-1" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:100] if damage == "truncate" else b"\xff" * 16)
    with pytest.raises(BundleError) as info:
        load_model(bundle / "constituent-1")
    msg = str(info.value)
    assert str(weights) in msg
    assert "re-train" in msg and "copy the model again" in msg
    assert isinstance(info.value.__cause__, SafetensorError)
    load_model(bundle / "constituent-0")  # the intact one still loads


def test_corrupt_safetensors_is_one_cli_line(tiny_bundle, tmp_path, capsys):
    bundle = _writable_copy(tiny_bundle, tmp_path / "b")
    weights = bundle / "constituent-1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name: Ada Lovelace, ID:\n", encoding="utf-8")
    argv = ["bounds", str(bundle), "--out", str(tmp_path / "o"), "--prompts", str(prompts)]
    assert main([*argv, "--methods", "cp-delta", "--n", "1", "--max-tokens", "2"]) == 2
    (line,) = _error_lines(capsys)
    assert str(weights) in line and "re-train" in line


# ----------------------------------------------------------------------------- 3. eval, no data


def test_eval_with_only_attacks_lacking_data_fails_and_writes_nothing(
    tiny_bundle, parts_without_canaries, tmp_path, capsys
):
    out = tmp_path / "o"
    out.mkdir()
    previous = '[{"kept": true}]\n'
    (out / "results.json").write_text(previous, encoding="utf-8")
    argv = ["eval", str(tiny_bundle), "--data", str(parts_without_canaries), "--out", str(out)]
    assert main([*argv, "--attacks", "canary", "--methods", "cp-delta"]) == 2
    (line,) = _error_lines(capsys)
    assert "canary" in line and "no canaries" in line and "--canaries" in line
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    assert (out / "results.json").read_text(encoding="utf-8") == previous

    fresh = tmp_path / "fresh"  # nor is the output directory created
    argv = ["eval", str(tiny_bundle), "--data", str(parts_without_canaries), "--out", str(fresh)]
    assert main([*argv, "--attacks", "canary", "--methods", "cp-delta"]) == 2
    assert not fresh.exists()


def test_eval_runs_the_attacks_that_have_data(
    tiny_bundle, parts_without_canaries, tmp_path, caplog
):
    out = tmp_path / "o"
    argv = ["eval", str(tiny_bundle), "--data", str(parts_without_canaries), "--out", str(out)]
    argv += ["--attacks", "canary,pii", "--methods", "cp-delta", "--pii-n", "2"]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert {r["attack"] for r in rows} == {"pii"}
    assert "canary skipped: no canaries" in caplog.text


def test_missing_data_names_each_attack_without_data(parts_without_canaries):
    from scpdr.attacks.evaluation import ATTACKS, EvalData, missing_data

    data = EvalData.from_partitions(parts_without_canaries)
    assert missing_data(data, ATTACKS) == {
        "canary": "no canaries in the data",
        "secrets": "no declared secrets in the data (--secrets-field, --secret-pattern)",
    }
    assert set(missing_data(EvalData(), ATTACKS)) == set(ATTACKS)


# ----------------------------------------------------------------------------- 4. atomic writes


def test_atomic_write_error_names_the_target_not_the_temp_file(tmp_path):
    from scpdr.io import atomic_write_json

    target = tmp_path / "results.json"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_json(target, {"a": 1})
    assert str(target) in str(info.value)
    assert ".tmp" not in str(info.value)
    assert ".tmp" in str(info.value.__cause__)  # the original is kept as the cause
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left


def test_atomic_write_disk_full_names_the_target(tmp_path):
    from scpdr.io import atomic_write

    def write(tmp: Path) -> None:  # what a full disk raises: the OS names the file written
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    target = tmp_path / "model.bin"
    with pytest.raises(OSError) as info:
        atomic_write(target, write)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(target)
    assert ".tmp" not in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []

    def write_plain(tmp: Path) -> None:  # an OSError without errno that names the temp file
        raise OSError(f"could not serialize to {tmp}")

    with pytest.raises(OSError, match=r"model\.bin") as info:
        atomic_write(target, write_plain)
    assert ".tmp" not in str(info.value)


# ----------------------------------------------------------------------------- 5. "pass overwrite"


def test_finetune_over_another_run_says_what_the_user_can_do(tmp_path):
    from scpdr.data import Record
    from scpdr.training import TRAIN_INFO, finetune

    out = tmp_path / "constituent-0"
    out.mkdir()
    (out / TRAIN_INFO).write_text('{"fingerprint": "another run"}', encoding="utf-8")
    records = [Record(id="a", text="hello world")]
    with pytest.raises(ConfigError) as info:
        finetune(records, base="embedded", out=out)
    msg = str(info.value)
    assert f"delete {out} to train there again" in msg and "choose another --out" in msg
    assert "pass overwrite" not in msg
    assert "in Python: another out, or finetune's overwrite argument" in msg


def test_save_partitions_over_a_directory_says_what_the_user_can_do(parts_without_canaries):
    from scpdr.data.partition import load_partitions, save_partitions
    from scpdr.data.records import DataError

    pset = load_partitions(parts_without_canaries)
    with pytest.raises(DataError) as info:
        save_partitions(parts_without_canaries, pset)
    msg = str(info.value)
    assert "delete it or choose another output directory" in msg
    assert "in Python, save_partitions(..., overwrite=True)" in msg
