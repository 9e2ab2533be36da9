"""The CLI's options come from the library's config models: `scpdr train` has one option per
TrainConfig field (name, help, default, bounds), every bound the config enforces is enforced on the
command line with an error naming the option, the field-mapping options are the same on `train`
and `partition`, and every command's --help fits 80 columns without cutting a word."""

from __future__ import annotations

import re

import pytest
import typer

from scpdr import cli
from scpdr.commands.options import FIELD_OPTIONS, TRAIN_OPTIONS, bounds_text
from scpdr.training import PAPER_DEFAULTS, TrainConfig


def _command(name: str):
    return typer.main.get_command(cli.app).commands[name]  # type: ignore[attr-defined]


def _param(command, flag: str):
    found = [p for p in command.params if flag in p.opts]
    assert len(found) == 1, f"{command.name}: {flag} names {len(found)} options"
    return found[0]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Options of `scpdr train` that are not TrainConfig fields (data, bundle and output settings).
NOT_TRAINING = {
    "data",
    "partitions",
    "out",
    "base",
    "n_train",
    "n_val",
    "val_fraction",
    "resume",
    "split",
    "seed",
    "canaries",
    "config",
    "allow_failed_audit",
    "method",
    "m",
    "device",  # where training runs (scpdr.device), not a TrainConfig field
}
TRAIN_FIELDS = [n for n in TrainConfig.model_fields if n != "seed"]


@pytest.mark.parametrize("name", TRAIN_FIELDS)
def test_every_train_config_field_is_an_option_with_its_help_default_and_bounds(name):
    info = TrainConfig.model_fields[name]
    param = _param(_command("train"), _flag(name))
    help_text = " ".join(param.help.split())
    assert help_text.startswith(" ".join(info.description.split()))
    default = TrainConfig.default_text(name)
    if name in PAPER_DEFAULTS:  # the mode-dependent default names both modes
        full, lora = PAPER_DEFAULTS[name]
        assert f"default: {full} (LoRA: {lora})" in help_text
    elif default is not None:
        assert f"default: {default}" in help_text
    rng = bounds_text(TrainConfig, name)
    if rng is not None:
        assert rng in help_text
    assert param.default is None  # unset: the config (or --config FILE) decides
    if info.annotation is bool or info.annotation == bool | None:
        assert param.secondary_opts == [f"--no-{_flag(name)[2:]}"]


def test_train_has_no_hand_written_training_option():
    params = {p.name for p in _command("train").params}
    generated = {TRAIN_OPTIONS.param(n) for n in TRAIN_FIELDS}
    others = {p for p in params if "__" in p and p not in generated}  # field, grouping, canary
    # the one hand-written training flag is --bf16/--no-bf16, a hidden former spelling of the
    # generated --precision (kept so that scripts using it keep working)
    legacy = {"bf16"}
    assert params == NOT_TRAINING | generated | others | legacy
    assert all(_param(_command("train"), f"--{n}").hidden for n in legacy)
    assert all(not p.startswith(TRAIN_OPTIONS.dest) for p in others)
    assert "--lr" in _param(_command("train"), "--learning-rate").opts  # the short alias stays


def _out_of_bounds() -> list[tuple[str, str]]:
    cases = []
    for name in TRAIN_FIELDS:
        b = {}
        for m in TrainConfig.model_fields[name].metadata:
            b.update({k: getattr(m, k) for k in ("gt", "ge", "lt", "le") if hasattr(m, k)})
        if "gt" in b:
            cases.append((name, str(b["gt"])))
        if "ge" in b:
            cases.append((name, str(b["ge"] - 1)))
        if "lt" in b:
            cases.append((name, str(b["lt"])))
        if "le" in b:
            cases.append((name, str(b["le"] + 1)))
    return cases


@pytest.mark.parametrize(("name", "value"), _out_of_bounds())
def test_a_value_out_of_the_config_bounds_is_one_line_naming_the_option(
    tmp_path, capsys, name, value
):
    out = tmp_path / "b"
    argv = ["train", "--data", "names2ids", "--out", str(out), "--base", "tiny"]
    assert cli.main([*argv, _flag(name), value]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{_flag(name)} ({name})" in err
    assert not out.exists()  # refused before any data or model work


def test_train_and_partition_share_the_field_mapping_options():
    for name in FIELD_OPTIONS.fields():
        flag = FIELD_OPTIONS.flags_of(name)[0]
        a, b = _param(_command("train"), flag), _param(_command("partition"), flag)
        assert a.help == b.help and a.opts == b.opts and a.default is None
    assert [FIELD_OPTIONS.flags_of(n)[0] for n in FIELD_OPTIONS.fields()] == [
        "--text-field",
        "--prompt-field",
        "--response-field",
        "--id-field",
        "--messages-field",
        "--secrets-field",
        "--group-field",
    ]


# ------------------------------------------------------------------------------ help width

COMMANDS = sorted(typer.main.get_command(cli.app).commands)  # type: ignore[attr-defined]


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_fits_80_columns_without_cutting_words(monkeypatch, capsys, name):
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal still gets at most 80 columns
    argv = [name, "--help"] if name else ["--help"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    squashed = _squash(out)
    if name is None:  # every command's summary, whole
        for cmd in typer.main.get_command(cli.app).commands.values():  # type: ignore[attr-defined]
            assert _squash(cmd.short_help) in squashed
        return
    for param in _command(name).params:
        if getattr(param, "help", None) and not getattr(param, "hidden", False):
            assert _squash(param.help) in squashed, f"{param.name}'s help is cut"


def test_help_narrows_with_the_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    assert cli.main(["train", "--help"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 60


@pytest.mark.parametrize(("flag", "precision"), [("--bf16", "bf16"), ("--no-bf16", "fp32")])
def test_former_bf16_flag_of_train_is_precision(tmp_path, monkeypatch, capsys, flag, precision):
    """`scpdr train --bf16` / `--no-bf16` (hidden, the former spelling) set --precision bf16 /
    fp32; with a --precision that says otherwise it is an error naming both."""
    import scpdr.commands.train as train_cmd
    from scpdr.cli import main

    class Built(Exception):
        pass

    seen = {}

    def build(group, values, **fixed):
        seen.update(values)
        raise Built

    monkeypatch.setattr(train_cmd, "build", build)
    argv = ["train", "--data", "names2ids", "--out", str(tmp_path / "b"), flag]
    with pytest.raises(Built):
        main(argv)
    assert seen["precision"] == precision
    other = "fp32" if precision == "bf16" else "bf16"
    assert main([*argv, "--precision", other]) != 0
    err = capsys.readouterr().err
    assert f"{flag} contradicts --precision {other}" in err
    assert flag not in main_help()


def main_help() -> str:
    from typer.testing import CliRunner

    from scpdr.cli import app

    return CliRunner().invoke(app, ["train", "--help"]).output
