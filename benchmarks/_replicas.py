"""The replicas row of ``bench_serve.py``: two ``scpdr serve`` processes on one PostgreSQL ledger
(requests/s with 2 replicas ÷ 1, same processes, alternating rounds) and the ledger's added
latency per request (reserve + settle on PostgreSQL vs SQLite, interleaved).

What a 2-core host allows: each server decodes on one torch thread (``OMP_NUM_THREADS=1``) plus
its HTTP loop, and the 16 load-generating clients, PostgreSQL and the second server share the
same two cores, so two replicas can at best use the core that one leaves idle; on more cores the
ratio is bounded by the cores each replica gets.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("scpdr.benchmarks.serve")

#: reserve + settle pairs timed per ledger.
LEDGER_OPS = 300


def _mean_ci(xs: list[float]) -> dict[str, Any]:
    """Mean with its 95% t-interval (n = len(xs))."""
    from scipy import stats

    n = len(xs)
    mean = statistics.fmean(xs)
    if n < 2:
        return {"mean": round(mean, 3), "ci95": None, "n": n}
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return {"mean": round(mean, 3), "ci95": [round(mean - half, 3), round(mean + half, 3)], "n": n}


def _median_ci(xs: list[float], *, seed: int = 0) -> dict[str, Any]:
    """Median with its 95% percentile-bootstrap interval (2000 resamples, n = len(xs))."""
    import numpy as np

    a = np.asarray(xs)
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(a, size=(2000, a.size), replace=True), axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"median": round(float(np.median(a)), 4), "ci95": [round(lo, 4), round(hi, 4)],
            "n": int(a.size)}  # fmt: skip


def ledger_latency(pg_url: str, tmp: Path) -> dict[str, Any]:
    """Milliseconds per reserve + settle (what a request adds), each ledger in turn."""
    from scpdr.serve.ledger import open_ledger

    ledgers = {
        "sqlite": open_ledger(tmp / "ledger.sqlite", name="bench", budget=1e12),
        "postgres": open_ledger(pg_url, name="bench", budget=1e12),
    }
    samples: dict[str, list[float]] = {name: [] for name in ledgers}
    for i in range(LEDGER_OPS + 20):  # 20 warm-up rounds
        for name, ledger in ledgers.items():
            t0 = time.perf_counter()
            a = ledger.reserve("client", 1, cap=1.0)
            ledger.settle("client", a.reservation, 0.5)
            if i >= 20:
                samples[name].append(1000 * (time.perf_counter() - t0))
    for ledger in ledgers.values():
        ledger.close()
    out = {name: _median_ci(xs) for name, xs in samples.items()}
    ratio = out["postgres"]["median"] / out["sqlite"]["median"]
    return {"ledger_ms": out, "ledger_postgres_vs_sqlite": {"ratio": round(ratio, 2)}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(bundle: Path, db: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "scpdr", "serve", str(bundle), "--port", str(port),
        "--device", "cpu", "--log-level", "warning", "--served-model-name", "bench",
        "--max-batch", "16", "--max-queue", "64", "--client-budget", "1e12", "--budget-db", db,
        "--budget", "1e6",  # without it a request reserves the key's whole balance
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"a replica exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("a replica did not come up in 300 s")
        time.sleep(0.2)


def replicas_row(
    bundle: Path,
    tmp: Path,
    *,
    clients: Callable[..., Any],
    rounds: int,
    requests: int,
    max_tokens: int,
) -> dict[str, Any]:
    """The replicas row; empty values (null) when no PostgreSQL can be started here."""
    import httpx

    from scpdr.testing_postgres import PostgresUnavailableError, start_cluster

    try:
        cluster = start_cluster()
    except PostgresUnavailableError as exc:
        logger.warning("replicas row skipped: %s", exc)
        return {"replicas": None, "ledger_ms": None, "two_replicas_vs_one": None}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        db = cluster.create_database()
        out = ledger_latency(db, tmp)
        logger.info("ledger ms per request: %s", out["ledger_ms"])
        started = [_spawn(bundle, db, tmp / f"replica-{i}.log") for i in range(2)]
        procs = [p for p, _ in started]
        urls = [u for _, u in started]
        for i, (p, u) in enumerate(started):
            _wait(p, u, tmp / f"replica-{i}.log")
        for u in urls:  # warm-up outside the timing
            httpx.post(u + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=600)
        rps: dict[str, list[float]] = {"one": [], "two": []}
        errors = 0
        for r in range(rounds):
            for name, targets in (("one", urls[:1]), ("two", urls)):
                res = asyncio.run(
                    clients(targets, requests=requests, max_tokens=max_tokens, model="bench")
                )
                rps[name].append(len(res["latencies"]) / res["wall"])
                errors += res["errors"]
                logger.info("replicas round %d %-3s %.2f req/s", r, name, rps[name][-1])
        ratios = [two / one for one, two in zip(rps["one"], rps["two"], strict=True)]
        out["two_replicas_vs_one"] = _mean_ci(ratios)
        out["replicas"] = {
            "one_requests_per_s": _mean_ci(rps["one"]),
            "two_requests_per_s": _mean_ci(rps["two"]),
            "errors": errors,
            "cpus": os.cpu_count(),
            "how": "2 `scpdr serve` processes, one PostgreSQL ledger, client round-robin",
        }
        return out
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop()
