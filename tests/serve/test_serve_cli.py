"""``scpdr serve``: help, argument errors, and a real server process answering the API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from scpdr.cli import main


def test_serve_help(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--method", "--m", "--base", "--port", "--api-key", "--max-batch"):
        assert option in out


def test_serve_rejects_bad_arguments(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--base", "nope"]) == 2
    assert "--base" in capsys.readouterr().err


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
        assert models[0]["naf"]["name"] == "scp-delta-r-c"  # --base constant: the 'c' variant
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
