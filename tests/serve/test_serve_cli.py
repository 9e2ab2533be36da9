"""``scpdr serve``: help, argument errors, and a real server process answering the API."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from scpdr import methods
from scpdr.cli import main
from scpdr.serve.config import ServeConfig, option_spec


def test_serve_help_lists_an_option_per_config_field(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(ServeConfig):
        option, _ = option_spec(f.name)
        assert option in out, f"ServeConfig.{f.name} has no option {option} in `scpdr serve`"


def test_serve_options_map_onto_the_config():
    """Each parameter of the command is one ServeConfig field, with the field's default."""
    from scpdr.commands.serve import serve

    params = inspect.signature(serve).parameters
    options = {
        decl: p for p in params.values() if p.name != "bundle" for decl in p.default.param_decls
    }
    fields = {option_spec(f.name)[0]: f for f in dataclasses.fields(ServeConfig)}
    assert set(options) == set(fields)
    for decl, p in options.items():
        assert p.default.default == fields[decl].default, decl
        assert p.name == fields[decl].name, decl  # the command passes its parameters by name


def test_serve_rejects_bad_arguments(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--base", "nope"]) == 2
    assert "--base" in capsys.readouterr().err


def test_a_busy_port_is_reported_before_any_model_loads(serve_bundle, tmp_path, capsys):
    bundle = tmp_path / "bundle"
    shutil.copytree(serve_bundle, bundle)
    for weights in bundle.glob("constituent-0/*.safetensors"):
        weights.write_bytes(b"not weights")  # loading the models would fail differently
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(bundle), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "in use" in err, err
    assert len(err.strip().splitlines()) == 1


def test_an_unreachable_ledger_or_a_sqlite_one_for_replicas_stops_the_server_first(
    serve_bundle, tmp_path, capsys
):
    bundle = tmp_path / "bundle"
    shutil.copytree(serve_bundle, bundle)
    for weights in bundle.glob("constituent-0/*.safetensors"):
        weights.write_bytes(b"not weights")  # loading the models would fail differently
    db = "postgresql://alice:pw@127.0.0.1:1/ledger"
    args = ["serve", str(bundle), "--device", "cpu", "--port", "0", "--client-budget", "5"]
    assert main([*args, "--budget-db", db]) == 2
    err = capsys.readouterr().err
    assert "cannot use the budget ledger at postgresql://alice:***@127.0.0.1:1/ledger" in err
    assert "pw@" not in err and len(err.strip().splitlines()) == 1, err
    assert main([*args, "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "--budget-db must be a PostgreSQL URL with --replicas 2" in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_a_clear_error(serve_bundle, capsys):
    assert main(["serve", str(serve_bundle), "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_bad_device_is_rejected(serve_bundle, capsys):
    assert main(["serve", str(serve_bundle), "--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_answers_completions(serve_bundle):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "scpdr",
        "serve",
        str(serve_bundle),
        "--port",
        str(port),
        "--api-key",
        "k",
        "--max-batch",
        "2",
        "--base",
        "constant",
        "--log-level",
        "warning",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
        assert models[0]["id"] == serve_bundle.name
        c_variant = next(
            s for s in methods.SPECS.values() if s.rule == "scp-delta-r" and s.base == "constant"
        )
        assert models[0]["naf"]["name"] == c_variant.name  # --base constant: the 'c' variant
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        out = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).json()
        assert len(out["choices"][0]["naf"]["k_x"]) == out["usage"]["completion_tokens"] == 3
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
