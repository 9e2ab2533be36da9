"""Concurrent clients share model steps without errors; a full queue answers 429."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPTS = [
    "The weather explains",
    "My friend asks about the",
    "A small cat",
    "This function returns",
]
CLIENTS, REQUESTS = 16, 20


@pytest.fixture(scope="module")
def base_url(start_server):
    with start_server(max_batch=16, max_queue=256) as url:
        yield url


def _request(http: httpx.Client, client: int, i: int, model: str) -> tuple[str, str, dict]:
    """One of four request kinds, chosen by (client, i); returns (kind, prompt, result)."""
    prompt = PROMPTS[(client + i) % len(PROMPTS)]
    kind = ["completion", "stream", "chat", "echo"][(client * 7 + i) % 4]
    if kind == "chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 3,
            "temperature": 0,
        }
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return kind, prompt, r.json()
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    if kind == "echo":
        body.update(echo=True, logprobs=1, max_tokens=1)
    if kind == "stream":
        body["stream"] = True
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        text = "".join(c["choices"][0]["text"] for c in chunks)
        return kind, prompt, {"choices": [{"text": text}]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return kind, prompt, r.json()


def test_concurrent_clients_get_correct_answers_from_shared_batches(base_url, serve_lm, model_id):
    def client(c: int) -> list[tuple[str, str, dict]]:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            return [_request(http, c, i, model_id) for i in range(REQUESTS)]

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [r for rs in pool.map(client, range(CLIENTS)) for r in rs]
    assert len(results) == CLIENTS * REQUESTS

    # greedy answers do not depend on what else was in the batch
    ref = {
        p: g.text
        for p, g in zip(PROMPTS, serve_lm.generate(PROMPTS, max_new_tokens=3), strict=True)
    }
    for kind, prompt, out in results:
        text = (
            out["choices"][0]["message"]["content"] if kind == "chat" else out["choices"][0]["text"]
        )
        if kind in ("completion", "stream"):
            assert text == ref[prompt]
        elif kind == "echo":
            assert text.startswith(prompt)
            assert len(out["choices"][0]["naf"]["prompt_k_x"]) == out["usage"]["prompt_tokens"]
    stats = httpx.get(base_url + "/health").json()
    assert stats["status"] == "ok"
    assert stats["largest_batch"] > 1  # requests shared model steps
    assert stats["batches_run"] < stats["sequences_run"]


def test_full_queue_answers_429(start_server, model_id):
    with start_server(max_batch=1, max_queue=2) as url:

        def one(_: int) -> httpx.Response:
            body = {"model": model_id, "prompt": "The report", "max_tokens": 24, "temperature": 0}
            return httpx.post(url + "/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(one, range(12)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1"
        err = busy.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and set(err) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_small_responses_are_not_held_back_by_delayed_acks(base_url):
    """The listening socket is TCP (so asyncio sets TCP_NODELAY on each connection): otherwise a
    response written as head + body waits ~40 ms for the client's delayed ACK, every time."""
    import time

    with httpx.Client(base_url=base_url, timeout=60) as http:
        http.get("/health")
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            times.append(time.perf_counter() - t0)
    assert min(times) < 0.02, f"fastest /health took {min(times) * 1e3:.1f} ms"
