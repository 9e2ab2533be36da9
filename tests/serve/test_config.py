"""ServeConfig: one settings object, validated at construction, naming the option to fix."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from scpdr import methods
from scpdr.errors import ConfigError
from scpdr.serve.config import DEFAULT_MODEL_NAME, UNPROTECTED_METHOD, ServeConfig
from scpdr.serve.server import PortUnavailableError, bind_socket, check_bundle


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"method": "cp-delta-rr"}, "--method 'cp-delta-rr'"),
        ({"m": 0}, "--m must be >= 1"),
        ({"base": "nope"}, "--base"),
        ({"device": "tpu"}, "--device"),
        ({"port": 70000}, "--port must be <= 65535"),
        ({"port": "80"}, "--port must be a number"),
        ({"log_level": "loud"}, "--log-level"),
        ({"model_name": ""}, "--served-model-name must not be empty"),
        ({"api_key": ""}, "--api-key"),
        ({"max_request_bytes": 10}, "--max-request-bytes must be >= 1024"),
        ({"max_sequences_per_request": 0}, "--max-sequences"),
        ({"max_batch": 0}, "--max-batch"),
        ({"max_queue": True}, "--max-queue must be a number"),
        ({"batch_wait_s": -1.0}, "--batch-wait"),
    ],
)
def test_bad_settings_name_the_option_and_the_field(kw, needle):
    with pytest.raises(ConfigError, match="ServeConfig") as err:
        ServeConfig(**kw)
    assert needle in str(err.value)


@pytest.mark.parametrize("rule", methods.RULES)
def test_every_rule_is_accepted(rule):
    unprotected = rule == UNPROTECTED_METHOD  # constituent 0 alone: only when asked for
    assert ServeConfig(method=rule, unprotected=unprotected).method == rule


def test_method_none_needs_unprotected_and_unprotected_needs_method_none():
    with pytest.raises(ConfigError, match="--unprotected") as err:
        ServeConfig(method="none")
    assert "no protection" in str(err.value) and "ServeConfig.method" in str(err.value)
    assert ServeConfig(method="none", unprotected=True).unprotected
    with pytest.raises(ConfigError, match="--unprotected applies to --method none only"):
        ServeConfig(method="cp-delta-r", unprotected=True)
    ServeConfig(unprotected=True)  # the bundle's method decides (check_bundle, create_app)


def test_round_trips_through_json_and_names_the_served_model():
    config = ServeConfig(method="cp-delta-r", port=0, device="cuda:1", batch_wait_s=0, m=3)
    assert ServeConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
    assert ServeConfig().served_model_name == DEFAULT_MODEL_NAME
    assert ServeConfig(model_name="x").served_model_name == "x"
    assert ServeConfig(log_level="DEBUG").log_level == "debug"  # uvicorn's keys are lower case


def test_bind_socket_reports_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=f"port {port} is in use"):
            bind_socket("127.0.0.1", port)
    sock = bind_socket("127.0.0.1", 0)  # 0: any free port
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_check_bundle_refuses_settings_the_bundle_cannot_run(serve_bundle, tmp_path):
    manifest = check_bundle(serve_bundle, ServeConfig())
    assert manifest.vocab_size > 10
    with pytest.raises(ConfigError, match=f"--m {manifest.vocab_size}"):
        check_bundle(serve_bundle, ServeConfig(m=manifest.vocab_size))
    check_bundle(serve_bundle, ServeConfig(method="cp-delta", m=manifest.vocab_size))  # no m
    with pytest.raises(ValueError, match="not a bundle"):
        check_bundle(tmp_path, ServeConfig())


def test_check_bundle_refuses_a_bundle_whose_default_method_is_none(serve_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(serve_bundle, bundle)
    manifest = json.loads((bundle / "scpdr.json").read_text())
    (bundle / "scpdr.json").write_text(json.dumps({**manifest, "method": "none"}))
    with pytest.raises(ConfigError, match="--unprotected"):
        check_bundle(bundle, ServeConfig())
    check_bundle(bundle, ServeConfig(unprotected=True))
    check_bundle(bundle, ServeConfig(method="cp-delta"))  # a protected method overrides it
