"""Throughput and latency of ``scpdr serve`` under 16 concurrent clients: dynamic batching
(``--max-batch 16``) against one sequence at a time (``--max-batch 1``).

A live server (uvicorn in a background thread, 127.0.0.1, free port) serves a protected model;
16 asyncio clients each send ``--requests`` greedy /v1/completions requests back to back
(``--max-tokens`` tokens each). The two configurations run in alternating rounds over the same
ProtectedLM, so both see the same machine load (the CPU is shared). Reported: completed requests
per second of each, their ratio (goal >= 2x), and p50/p99 request latency of the batched server.

- ``--quick``: a tiny random bundle with the real tokenizer (``scpdr.testing.make_tiny_bundle``),
  5 requests per client, 8 tokens; well under 5 minutes.
- default: SCP-Δr-b on the embedded SmolLM2-135M (base + two perturbed copies as constituents,
  built in memory), 3 requests per client, 16 tokens.
- ``--bundle PATH``: serve that bundle instead.

Then the **replicas row** (``_replicas.py``): two ``scpdr serve`` processes on this host
sharing one PostgreSQL ledger (a throwaway cluster, :mod:`scpdr.testing_postgres`), the 16
clients sending every request to one of them, then spreading them over both (alternating rounds,
same processes): requests/s with 2 replicas ÷ 1, and the ledger's added latency per request
(reserve + settle, PostgreSQL vs SQLite). ``--no-replicas`` skips it; without PostgreSQL it is
reported as null.

    python benchmarks/bench_serve.py [--quick] [--bundle PATH] [--rounds N] [--no-replicas]

Last stdout line: ``{"bench": "serve", "ratios": {"batched_vs_sequential": ...,
"two_replicas_vs_one": ..., "ledger_postgres_vs_sqlite": ...}, "p50_ms": ..., "replicas": {...},
"ledger_ms": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, setup

logger = logging.getLogger("scpdr.benchmarks.serve")

GOAL = 2.0
CLIENTS = 16
PROMPTS = [
    "The weather explains the results of",
    "My friend asks about the meeting and",
    "A small cat shows an old story to",
    "This function returns a list of numbers when",
    "The report describes the answer in",
    "Write a short note about the garden:",
    "Explain how a hash table works:",
    "List three tips for clear code:",
]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def _clients(
    url: str | list[str],
    *,
    requests: int,
    max_tokens: int,
    model: str,
) -> dict[str, Any]:
    """``CLIENTS`` concurrent clients, ``requests`` each; with several URLs (replicas) each
    request goes to the next one (a round-robin load balancer)."""
    import httpx

    urls = [url] if isinstance(url, str) else url

    latencies: list[float] = []
    tokens = 0
    errors = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        for i in range(requests):
            body = {
                "model": model,
                "prompt": PROMPTS[(c + i) % len(PROMPTS)],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            target = urls[(c + i) % len(urls)]
            r = await http.post(target + "/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors += 1
                logger.warning("request failed: %s %s", r.status_code, r.text[:200])
                continue
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(CLIENTS)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "latencies": latencies, "tokens": tokens, "errors": errors}


def _round(lm: Any, *, max_batch: int, requests: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    from scpdr.serve import Engine, ServeConfig, create_app, serve_in_background

    config = ServeConfig(model_name="bench", max_batch=max_batch, max_queue=4 * CLIENTS)
    engine = Engine.from_config(lm, config)
    app = create_app(engine, config)
    with serve_in_background(app) as url:
        # one warm-up request (first-call allocations) outside the timing
        httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=600)
        out = asyncio.run(_clients(url, requests=requests, max_tokens=max_tokens, model="bench"))
        out["largest_batch"] = engine.stats()["largest_batch"]
    return out


def _tiny_lm(tmp: Path) -> Any:
    from scpdr.runtime import ProtectedLM
    from scpdr.testing import make_tiny_bundle

    return ProtectedLM.from_bundle(make_tiny_bundle(tmp / "bundle"))


def _embedded_lm() -> Any:
    from scpdr.models import load_base
    from scpdr.runtime import ProtectedLM
    from scpdr.testing import perturbed_copy

    base, tok = load_base()
    constituents = [perturbed_copy(base, seed=s) for s in (1, 2)]
    return ProtectedLM(constituents, tok, base_model=base, method="scp-delta-r", m=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny bundle, fewer requests (< 5 min)")
    ap.add_argument("--bundle", type=Path, help="serve this bundle instead")
    ap.add_argument("--requests", type=int, help="requests per client and round")
    ap.add_argument("--max-tokens", type=int, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per configuration")
    ap.add_argument("--max-batch", type=int, default=CLIENTS, help="batched configuration")
    ap.add_argument("--threads", type=int, help="torch threads (default min(2, cpus))")
    ap.add_argument("--no-replicas", action="store_true", help="skip the replicas row")
    args = ap.parse_args(argv)
    threads = setup(threads=args.threads)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    requests = args.requests or (5 if args.quick else 3)
    max_tokens = args.max_tokens or (8 if args.quick else 16)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        bundle = args.bundle
        if args.bundle is not None:
            from scpdr.runtime import ProtectedLM

            lm, model = ProtectedLM.from_bundle(args.bundle), str(args.bundle)
        elif args.quick:
            lm, model = _tiny_lm(Path(tmp)), "tiny"
            bundle = Path(tmp) / "bundle"
        else:
            lm = _embedded_lm()
            model = f"SmolLM2-135M ({lm.name}, K={lm.num_constituents})"
        logger.info("model ready in %.1fs: %s", time.perf_counter() - t0, lm)

        configs = {"batched": args.max_batch, "sequential": 1}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, mb in configs.items():
                out = _round(lm, max_batch=mb, requests=requests, max_tokens=max_tokens)
                runs[name].append(out)
                logger.info(
                    "round %d %-10s %.2fs  %d req  %d tokens  largest batch %d  errors %d",
                    r,
                    name,
                    out["wall"],
                    len(out["latencies"]),
                    out["tokens"],
                    out["largest_batch"],
                    out["errors"],
                )
        replicas: dict[str, Any] = {}
        if not args.no_replicas:
            from _replicas import replicas_row

            if bundle is None:  # the in-memory embedded model has no bundle: a tiny one
                from scpdr.testing import make_tiny_bundle

                bundle = make_tiny_bundle(Path(tmp) / "bundle")
            replicas = replicas_row(
                bundle,
                Path(tmp),
                clients=_clients,
                rounds=args.rounds + 1,
                requests=requests,
                max_tokens=max_tokens,
            )

    def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
        wall = sum(x["wall"] for x in rs)
        lat = [v for x in rs for v in x["latencies"]]
        return {
            "requests_per_s": len(lat) / wall,
            "tokens_per_s": sum(x["tokens"] for x in rs) / wall,
            "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * _percentile(lat, 99),
            "errors": sum(x["errors"] for x in rs),
            "largest_batch": max(x["largest_batch"] for x in rs),
        }

    s = {name: summary(rs) for name, rs in runs.items()}
    ratio = s["batched"]["requests_per_s"] / s["sequential"]["requests_per_s"]
    logger.info("batched vs sequential: %.2fx (goal >= %.1fx)", ratio, GOAL)
    ratios = {"batched_vs_sequential": round(ratio, 3)}
    for key in ("two_replicas_vs_one", "ledger_postgres_vs_sqlite"):
        if replicas.get(key) is not None:
            ratios[key] = replicas[key]["mean" if key.startswith("two") else "ratio"]
    emit(
        "serve",
        ratios,
        p50_ms=round(s["batched"]["p50_ms"], 1),
        p99_ms=round(s["batched"]["p99_ms"], 1),
        goal=GOAL,
        model=model,
        clients=CLIENTS,
        requests_per_client=requests * args.rounds,
        max_tokens=max_tokens,
        threads=threads,
        batched={k: round(v, 2) if isinstance(v, float) else v for k, v in s["batched"].items()},
        sequential={
            k: round(v, 2) if isinstance(v, float) else v for k, v in s["sequential"].items()
        },
        **replicas,
    )
    replica_errors = (replicas.get("replicas") or {}).get("errors", 0)
    ok = s["batched"]["errors"] == 0 and s["sequential"]["errors"] == 0 and replica_errors == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
