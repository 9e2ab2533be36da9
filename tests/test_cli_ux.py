"""What a new user trips on: a wrong option value is one line naming the option (exit 2), checked
before any model loads or trains, never a traceback; `serve` defaults to the bundle's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from scpdr.cli import main


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parts") / "p"
    argv = ["partition", "names2ids", "--out", str(out), "--n-train", "8", "--n-val", "2"]
    assert main(argv) == 0
    return out


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "errors.pydantic.dev" not in err
    for n in needles:
        assert n in err, err
    return err


# ----------------------------------------------------------------------------- settings models


def test_settings_model_rejection_is_one_line(parts, capsys):
    assert main(["audit-partitions", str(parts), "--threshold", "5"]) == 2
    err = _one_line_error(capsys, "threshold", "less than 1", "5.0")
    assert len(err.strip().splitlines()) == 1


def test_invalid_training_option_is_one_line(tmp_path, capsys):
    argv = ["train", "--data", "names2ids", "--out", str(tmp_path / "b"), "--base", "tiny"]
    assert main([*argv, "--lr", "-1"]) == 2
    err = _one_line_error(capsys, "learning_rate", "greater than 0")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- bundle / train


def test_train_refuses_an_unknown_method_before_training(tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["train", "--data", "names2ids", "--n-train", "8", "--n-val", "2", "--base", "tiny"]
    assert main([*argv, "--max-steps", "1", "--out", str(out), "--method", "cp-delta-rr"]) == 2
    _one_line_error(capsys, "--method 'cp-delta-rr'", "scp-delta-r")
    assert not out.exists()  # nothing trained


def test_train_refuses_m_zero_before_training(tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["train", "--data", "names2ids", "--n-train", "8", "--n-val", "2", "--base", "tiny"]
    assert main([*argv, "--max-steps", "1", "--out", str(out), "--m", "0"]) == 2
    _one_line_error(capsys, "--m")
    assert not out.exists()


def test_bundle_refuses_an_unknown_method(tiny, tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["bundle", str(out), "-c", str(tiny / "constituent-0"), "--base", str(tiny / "base")]
    assert main([*argv, "--method", "foo"]) == 2
    _one_line_error(capsys, "--method 'foo'", "cp-delta-r")
    assert not out.exists()


def test_bundle_refuses_m_zero_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["bundle", str(out), "-c", str(tiny / "constituent-0"), "--base", str(tiny / "base")]
    assert main([*argv, "--m", "0"]) == 2
    _one_line_error(capsys, "--m")
    assert not out.exists()


# ----------------------------------------------------------------------------- eval / bounds


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--m", "0"], "--m"),
        (["--m", "60000"], "vocabulary size (49152)"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--precision", "fp16"], "--precision must be one of auto, fp32, bf16"),
    ],
)
def test_eval_bad_numbers_are_one_line(tiny, parts, tmp_path, capsys, extra, needle):
    argv = ["eval", str(tiny), "--out", str(tmp_path / "e"), "--data", str(parts)]
    argv += ["--attacks", "pii", "--methods", "none,scp-delta-r-b", "--pii-n", "2"]
    assert main([*argv, *extra]) == 2
    _one_line_error(capsys, needle)
    assert not (tmp_path / "e").exists()


def test_eval_attacks_the_models_in_the_precision_asked(tiny, parts, tmp_path):
    """``--precision bf16``: the attacks run on the bf16 models (what ``scpdr serve --precision
    bf16`` serves) and write their rows; fp32 likewise."""
    import json

    for precision in ("bf16", "fp32"):
        out = tmp_path / precision
        argv = ["eval", str(tiny), "--out", str(out), "--data", str(parts), "--attacks", "pii"]
        argv += ["--methods", "none,scp-delta-r-b", "--pii-n", "2", "--precision", precision]
        assert main(argv) == 0
        rows = json.loads((out / "results.json").read_text(encoding="utf-8"))
        assert {"none", "scp-delta-r-b"} <= {r["method"] for r in rows}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--m", "0"], "--m"),
        (["--m", "49152"], "vocabulary size (49152)"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_bounds_bad_numbers_are_one_line(tiny, tmp_path, capsys, extra, needle):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nthe cat sat\n", encoding="utf-8")
    argv = ["bounds", str(tiny), "--out", str(tmp_path / "o"), "--prompts", str(prompts)]
    assert main([*argv, "--methods", "cp-delta", *extra]) == 2
    _one_line_error(capsys, needle)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- serve


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--port", "99999"], "--port"),
        (["--method", "cp-delta-rr"], "--method 'cp-delta-rr'"),
        (["--m", "0"], "--m"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_serve_bad_options_are_one_line(tiny, capsys, extra, needle):
    assert main(["serve", str(tiny), *extra]) == 2
    _one_line_error(capsys, needle)


def test_serve_defaults_to_the_bundles_m(tiny, tmp_path, capsys):
    """A bundle whose m cannot run (m >= V): `serve` without --m must use it, not a fixed 10."""
    import json
    import shutil
    import socket

    bundle = Path(shutil.copytree(tiny, tmp_path / "b"))  # a copy: the shared one stays intact
    manifest = json.loads((bundle / "scpdr.json").read_text())  # write_bundle refuses m >= V:
    manifest["m"] = 100_000  # a hand-edited manifest
    (bundle / "scpdr.json").write_text(json.dumps(manifest))
    with socket.socket() as busy:  # should the bundle's m be ignored, uvicorn fails to bind
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["serve", str(bundle), "--port", str(port)])
    assert rc == 2
    _one_line_error(capsys, "100000")


# ----------------------------------------------------------------------------- partition, misc


def test_partition_refuses_an_existing_out_naming_the_cli_fix(parts, capsys):
    assert main(["partition", "names2ids", "--out", str(parts), "--n-train", "8"]) == 2
    err = _one_line_error(capsys, "--out", "already exists")
    assert "pass overwrite" not in err  # a library argument, not a CLI option


def test_partition_num_perm_out_of_range(tmp_path, capsys):
    argv = ["partition", "names2ids", "--out", str(tmp_path / "p"), "--n-train", "8"]
    assert main([*argv, "--num-perm", "0"]) == 2
    _one_line_error(capsys, "--num-perm")


@pytest.mark.parametrize("scale", ["-1", "0"])
def test_prop_bounds_non_positive_q_scale(tmp_path, capsys, scale):
    argv = ["prop-bounds", "--out", str(tmp_path / "o"), "--n", "50", "--trials", "2"]
    assert main([*argv, "--q-scale", scale]) == 2
    _one_line_error(capsys, "--q-scale")


def test_experiment_force_that_matches_no_stage(tmp_path, capsys):
    from scpdr.commands.demo import demo_config_path

    argv = ["experiment", str(demo_config_path()), "--out", str(tmp_path / "r"), "--dry-run"]
    assert main([*argv, "--force", "trian"]) == 2
    _one_line_error(capsys, "--force 'trian'", "--dry-run")
    assert main([*argv, "--force", "train"]) == 0
    out = capsys.readouterr().out
    assert "forced" in out and "train/" in out


def test_demo_with_a_missing_config_names_it(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["demo", "--config", str(missing), "--out", str(tmp_path / "d")]) == 2
    _one_line_error(capsys, "nope.yaml", "does not exist")
    assert not (tmp_path / "d").exists()


def test_verbose_after_the_command_gets_a_hint(tmp_path, capsys):
    assert main(["partition", "names2ids", "--out", str(tmp_path / "p"), "-v"]) == 2
    assert "scpdr -v COMMAND" in capsys.readouterr().err


def test_serve_bundle_errors_name_the_cli_option(tiny, capsys):
    """The tiny bundle stores no constant vector: the fix is `--base model`, not `base='model'`."""
    assert main(["serve", str(tiny), "--base", "constant"]) == 2
    err = _one_line_error(capsys, "--base model")
    assert "base='" not in err


def test_train_on_a_partition_dir_refuses_options_it_would_ignore(parts, tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["train", "--data", str(parts), "--out", str(out), "--base", "tiny", "--max-steps", "1"]
    assert main([*argv, "--partitions", "3", "--canaries", "1,3"]) == 2
    _one_line_error(capsys, "--partitions 3", "--canaries", "partition directory")
    assert not out.exists()


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["eval", "--attacks", ""], "--attacks"),
        (["eval", "--methods", ""], "--methods"),
        (["bounds", "--methods", " , "], "--methods"),
    ],
)
def test_an_empty_list_option_is_refused(tiny, parts, tmp_path, capsys, command, option):
    """An empty --attacks/--methods used to write 0 result rows and exit 0."""
    out = tmp_path / "o"
    argv = [command[0], str(tiny), "--out", str(out), "--data", str(parts), *command[1:]]
    assert main(argv) == 2
    _one_line_error(capsys, f"{option} is empty")
    assert not out.exists()


@pytest.mark.parametrize("command", ["eval", "bounds", "prop-bounds", "experiment"])
def test_an_out_that_is_a_file_is_refused_before_the_work(tiny, parts, tmp_path, capsys, command):
    from scpdr.commands.demo import demo_config_path

    afile = tmp_path / "afile"
    afile.write_text("not a directory\n", encoding="utf-8")
    argv = {
        "eval": ["eval", str(tiny), "--data", str(parts), "--attacks", "pii", "--methods", "none"],
        "bounds": ["bounds", str(tiny), "--data", str(parts), "--methods", "cp-delta", "--n", "2"],
        "prop-bounds": ["prop-bounds", "--n", "50", "--trials", "2"],
        "experiment": ["experiment", str(demo_config_path()), "--dry-run"],
    }[command]
    assert main([*argv, "--out", str(afile)]) == 2
    _one_line_error(capsys, f"--out {afile} is a file")


def test_bounds_without_data_fails_before_loading_models(tiny, tmp_path, capsys):
    """No --prompts/--data and no extra.partitions: that error comes first, before the models are
    loaded (here a constituent's weights are corrupt, so loading would fail first)."""
    import shutil

    broken = tmp_path / "bundle"
    shutil.copytree(tiny, broken)
    (broken / "constituent-1" / "model.safetensors").write_bytes(b"not safetensors")
    assert main(["bounds", str(broken), "--out", str(tmp_path / "o"), "--methods", "cp-delta"]) == 2
    _one_line_error(capsys, "--prompts FILE or --data DIR")


def test_train_rerun_with_other_settings_names_a_cli_fix(tmp_path, capsys):
    """The library says 'pass overwrite=True'; the CLI has no such option."""
    out = tmp_path / "b"
    argv = ["train", "--data", "names2ids", "--n-train", "8", "--n-val", "2", "--base", "tiny"]
    argv += ["--out", str(out)]
    assert main([*argv, "--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main([*argv, "--max-steps", "2"]) == 2
    err = _one_line_error(capsys, "choose another --out", f"delete {out}")
    assert "overwrite=True" not in err
