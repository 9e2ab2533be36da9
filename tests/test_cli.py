"""The CLI entry point: every command has --help, bad usage is a message and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from scpdr import cli


def test_root_help(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "serve", "experiment", "demo", "bundle", "bounds"):
        assert name in out


@pytest.mark.parametrize("name", [c[2] for c in cli._COMMANDS])
def test_every_registered_command_has_help(name, capsys):
    assert cli.main([name, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    assert cli.main(["no-such-command"]) == 2
    assert "no-such-command" in capsys.readouterr().err


def test_bad_parameter_is_a_message_not_a_traceback(capsys):
    app = typer.Typer()

    @app.command()
    def cmd(x: int = typer.Option(1)) -> None:
        raise typer.BadParameter(f"x={x} is bad; use x=2")

    @app.command()
    def other() -> None:  # two commands, so typer keeps subcommand names
        pass

    saved = cli.app
    try:
        cli.app = app
        assert cli.main(["cmd"]) == 2
    finally:
        cli.app = saved
    assert "use x=2" in capsys.readouterr().err


def test_python_dash_m_is_the_same_cli():
    out = subprocess.run(
        [sys.executable, "-m", "scpdr", "--help"], capture_output=True, text=True, check=True
    )
    assert "experiment" in out.stdout


def test_typer_exit_code_is_returned():
    app = typer.Typer()

    @app.command()
    def fail() -> None:
        raise typer.Exit(code=3)

    @app.command()
    def other() -> None:
        pass

    saved = cli.app
    try:
        cli.app = app
        assert cli.main(["fail"]) == 3
    finally:
        cli.app = saved
