"""Small user-facing errors: each names the problem and what the user can do, as one line on the
CLI (exit 2), never a traceback or a message about a hidden temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from scpdr.cli import main
from scpdr.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from scpdr.testing import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("tiny"), k=2, constant_base=False)


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
