"""Method "none" (constituent 0 alone, unprotected) is served only with --unprotected, and then
with a WARNING on every start: from the command, and from the library (create_app)."""

from __future__ import annotations

import logging

import httpx
import pytest

from scpdr.errors import ConfigError
from scpdr.serve import Engine, ServeConfig, create_app, serve_in_background


def test_cli_refuses_method_none_without_unprotected(serve_bundle, capsys):
    from scpdr.cli import main

    assert main(["serve", str(serve_bundle), "--method", "none", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--unprotected" in err and "no protection" in err
    assert main(["serve", str(serve_bundle), "--method", "cp-delta", "--unprotected"]) == 2
    assert "applies to --method none only" in capsys.readouterr().err


def test_library_refuses_an_unprotected_model_unless_asked_and_warns_on_each_start(
    serve_bundle, caplog
):
    from scpdr.runtime import ProtectedLM

    lm = ProtectedLM.from_bundle(serve_bundle, method="none")
    with pytest.raises(ConfigError, match="--unprotected"):
        create_app(Engine.from_config(lm, ServeConfig()), ServeConfig())  # the lm's method
    config = ServeConfig(model_name="solo", unprotected=True)
    for _ in range(2):  # every start says it
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="scpdr.serve"):
            app = create_app(Engine.from_config(lm, config), config)
            with serve_in_background(app) as url:
                card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["naf"]["method"] == "none"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("UNPROTECTED" in r.getMessage() and "solo" in r.getMessage() for r in warnings)


def test_protected_methods_start_without_the_warning(serve_lm, caplog):
    with caplog.at_level(logging.WARNING, logger="scpdr.serve"):
        create_app(Engine.from_config(serve_lm, ServeConfig()), ServeConfig())
    assert not any("UNPROTECTED" in r.getMessage() for r in caplog.records)
