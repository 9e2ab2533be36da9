"""Replicas sharing one PostgreSQL ledger: two real ``scpdr serve`` processes on two ports (what a
load balancer in front of replicas sees), 8 concurrent clients on one API key; a replica killed
in the middle of a streamed response; and ``--replicas 2`` on Ray Serve."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

KEY = "replica-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The weather explains the results", "My friend asks about", "Write a short note:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``scpdr serve`` process (started by :meth:`start`, ready after :meth:`wait`)."""

    def __init__(self, bundle: Path, *args: str, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "scpdr", "serve", str(bundle), "--port", str(self.port),
            "--device", "cpu", "--log-level", "warning", "--api-key", KEY, *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Server:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and block it
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True
        )
        return self

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def wait(self, timeout: float = 120) -> Server:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up: {self.output()}"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no settling."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _charged(choice: dict) -> float:
    """What the server charges for a finished choice: sum_cost, or its whole budget after a
    budget stop (sum_cost + budget_left)."""
    naf = choice["naf"]
    if choice.get("finish_reason") == "budget":
        return naf["sum_cost"] + naf["budget_left"]
    return naf["sum_cost"]


def _ledger_rows(url: str) -> list[tuple[float, bool]]:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute("SELECT nats, settled FROM scpdr_budget_charges ORDER BY id").fetchall()


def _balance(url: str) -> dict:
    r = httpx.get(url + "/v1/budget", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


async def _fire(urls: list[str], seconds: float, clients: int = 8) -> dict:
    """``clients`` concurrent clients alternating between ``urls`` for ``seconds``: plain, n=2,
    echoed and streamed completions and chat. Returns the statuses, the 429 bodies and the sum
    of the certificates (charges) of every choice served."""
    statuses: list[int] = []
    refusals: list[dict] = []
    served: list[float] = []

    async def one(http: httpx.AsyncClient, url: str, k: int) -> None:
        kind = k % 4
        body: dict = {"max_tokens": 6, "temperature": 0}
        if kind == 3:
            body["messages"] = [{"role": "user", "content": PROMPTS[k % 3]}]
            path = "/v1/chat/completions"
        else:
            path = "/v1/completions"
            body.update(prompt=PROMPTS[k % 3], n=1 + (kind == 1), echo=kind == 1, logprobs=1)
        if kind == 2:
            body["stream"] = True
            async with http.stream("POST", url + path, json=body, headers=AUTH) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    refusals.append(json.loads(await r.aread()))
                    return
                finished: dict[int, dict] = {}
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        for c in chunk["choices"]:
                            if c.get("finish_reason"):
                                finished[c["index"]] = c
                served.extend(_charged(c) for c in finished.values())
            return
        r = await http.post(url + path, json=body, headers=AUTH)
        statuses.append(r.status_code)
        if r.status_code != 200:
            refusals.append(r.json())
            return
        served.extend(_charged(c) for c in r.json()["choices"])

    async def client(i: int, http: httpx.AsyncClient, deadline: float) -> None:
        k = i
        while time.monotonic() < deadline:
            await one(http, urls[k % len(urls)], k)
            k += 1

    async with httpx.AsyncClient(timeout=60) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(client(i, http, deadline) for i in range(clients)))
    return {"statuses": statuses, "refusals": refusals, "served": served}


def test_two_servers_on_one_postgres_ledger_never_overspend(serve_bundle, pg_url):
    budget = 40.0
    args = ("--client-budget", str(budget), "--budget", "3", "--budget-db", pg_url)
    servers = [Server(serve_bundle, *args).start() for _ in range(2)]
    try:
        for s in servers:
            s.wait()
        out = asyncio.run(_fire([s.url for s in servers], seconds=8.0))
        balances = [_balance(s.url) for s in servers]
    finally:
        for s in servers:
            s.stop()
    statuses = out["statuses"]
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.count(200) >= 8 and statuses.count(429) >= 8  # served, then refused
    assert set(statuses) == {200, 429}
    for body in out["refusals"]:  # OpenAI's error shape, naming the budget
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "budget_exceeded"
        assert body["error"]["type"] == "insufficient_quota"
    rows = _ledger_rows(pg_url)
    recorded = math.fsum(n for n, _ in rows)
    served = math.fsum(out["served"])
    assert all(settled for _, settled in rows)  # every request was settled
    assert recorded <= budget + 1e-9 and served <= budget + 1e-9
    assert served == pytest.approx(recorded, abs=1e-6)  # charged what was served
    assert balances[0]["spent"] == balances[1]["spent"] == pytest.approx(recorded, abs=1e-9)
    assert balances[0]["remaining"] < 1e-6 or statuses[-1] == 200


def test_a_killed_replica_leaves_its_reservation_and_the_other_keeps_serving(serve_bundle, pg_url):
    budget, per_response = 20000.0, 5000.0
    args = ("--client-budget", str(budget), "--budget", str(per_response), "--budget-db", pg_url)
    a, b = Server(serve_bundle, *args).start(), Server(serve_bundle, *args).start()
    try:
        a.wait()
        b.wait()
        body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", a.url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                a.kill()  # mid-response, before this client goes away (which would settle it)
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:
                        pass
        assert _ledger_rows(pg_url) == [(per_response, False)]  # the reservation stands
        assert _balance(b.url)["spent"] == per_response
        out = httpx.post(
            b.url + "/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0},
            headers=AUTH,
            timeout=60,
        )
        assert out.status_code == 200, out.text  # the other replica keeps serving
        charged = _charged(out.json()["choices"][0])
        a = Server(serve_bundle, *args, port=a.port).start().wait()  # restarted
        rows = _ledger_rows(pg_url)
        assert rows[0] == (per_response, False) and len(rows) == 2
        ledger_says = budget - math.fsum(n for n, _ in rows)
        assert ledger_says == pytest.approx(budget - per_response - charged, abs=1e-9)
        assert _balance(a.url)["remaining"] == pytest.approx(ledger_says, abs=1e-9)
        assert _balance(b.url)["remaining"] == pytest.approx(ledger_says, abs=1e-9)
    finally:
        a.stop()
        b.stop()


@pytest.mark.ray_serve
def test_replicas_on_ray_serve_answer_the_openai_client_and_share_the_ledger(serve_bundle, pg_url):
    """``scpdr serve --replicas 2`` (a local Ray instance): the openai client gets the same
    routes and naf fields, both replicas reserve on the one ledger, and 8 concurrent clients
    never get past the budget."""
    import openai
    import psycopg

    budget = 30.0
    args = ("--replicas", "2", "--client-budget", str(budget), "--budget", "3")
    server = Server(serve_bundle, *args, "--budget-db", pg_url, "--served-model-name", "m")
    try:
        server.start().wait(timeout=300)
        fired_at = time.time()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        out = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=3, temperature=0)
        naf = out.choices[0].model_extra["naf"]
        assert len(naf["k_x"]) == len(naf["cost"]) == out.usage.completion_tokens
        assert naf["sum_cost"] == pytest.approx(math.fsum(naf["cost"]), abs=1e-9)
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].model_extra["naf"]["budget_left"] is not None
        # Ray Serve's proxy answers as soon as one replica runs, while the other may still be
        # loading (seen: /health 200 ~1.5 s before the second replica's ledger connection): fire
        # in rounds until both replicas have used the ledger since ``fired_at`` (a refusal is a
        # ledger transaction too), or a minute has passed.
        fired: dict = {"statuses": [], "refusals": [], "served": []}
        deadline = time.monotonic() + 60
        while True:
            for key, values in asyncio.run(_fire([server.url], seconds=4.0)).items():
                fired[key] += values
            with psycopg.connect(pg_url) as conn:
                (replicas,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'scpdr-serve' AND query_start >= to_timestamp(%s)",
                    (fired_at,),
                ).fetchone()
            if replicas >= 2 or time.monotonic() > deadline:
                break
        balance = _balance(server.url)
    finally:
        server.stop(timeout=120)
    assert replicas == 2
    statuses = fired["statuses"]
    assert not [s for s in statuses if s >= 500] and 429 in statuses, statuses
    recorded = math.fsum(n for n, _ in _ledger_rows(pg_url))
    assert recorded <= budget + 1e-9 and balance["spent"] == pytest.approx(recorded, abs=1e-9)
    first = _charged(out.choices[0].model_dump()) + _charged(chat.choices[0].model_dump())
    assert math.fsum(fired["served"]) + first == pytest.approx(recorded, abs=1e-6)
