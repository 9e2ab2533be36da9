"""Bad input is answered with the right status and OpenAI's error shape, never a 500; failures
inside the model are a 500 (or an SSE error event once streaming) that names no internals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 8192


@pytest.fixture(scope="module")
def base_url(start_server) -> Iterator[str]:
    with start_server(api_key=KEY, max_request_bytes=LIMIT, max_sequences_per_request=64) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

# (id, method, path, json body or raw bytes, headers, status, param)
CASES: list[tuple[str, str, str, Any, dict | None, int, str | None]] = [
    ("no-key", "POST", C, OK, {}, 401, None),
    ("wrong-key", "POST", C, OK, {"Authorization": "Bearer nope"}, 401, None),
    ("basic-auth", "POST", C, OK, {"Authorization": f"Basic {KEY}"}, 401, None),
    ("models-no-key", "GET", "/v1/models", None, {}, 401, None),
    ("too-large", "POST", C, {"prompt": "a" * (LIMIT + 10)}, None, 413, None),
    ("unknown-route", "GET", "/v1/nothing", None, None, 404, None),
    ("wrong-method", "GET", C, None, None, 405, None),
    ("unknown-model", "POST", C, {**OK, "model": "gpt-9"}, None, 404, "model"),
    ("unknown-model-get", "GET", "/v1/models/gpt-9", None, None, 404, "model"),
    ("invalid-json", "POST", C, b'{"prompt": ', None, 400, None),
    ("json-array", "POST", C, [1, 2], None, 400, None),
    ("missing-prompt", "POST", C, {"max_tokens": 2}, None, 400, "prompt"),
    ("prompt-int", "POST", C, {"prompt": 5}, None, 400, "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, None, 400, "prompt"),
    ("prompt-empty-ids", "POST", C, {"prompt": [[]]}, None, 400, "prompt"),
    ("prompt-empty-str", "POST", C, {"prompt": ""}, None, 400, "prompt"),
    ("prompt-mixed", "POST", C, {"prompt": [1, "a"]}, None, 400, "prompt"),
    ("prompt-float-id", "POST", C, {"prompt": [1.5]}, None, 400, "prompt"),
    ("prompt-bool-id", "POST", C, {"prompt": [True]}, None, 400, "prompt"),
    ("negative-id", "POST", C, {"prompt": [-1]}, None, 400, "prompt"),
    ("oov-id", "POST", C, {"prompt": [49152]}, None, 400, "prompt"),
    ("oov-id-nested", "POST", C, {"prompt": [[1, 2], [10**9]]}, None, 400, "prompt"),
    ("max-tokens-negative", "POST", C, {**OK, "max_tokens": -1}, None, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, {**OK, "max_tokens": "10"}, None, 400, "max_tokens"),
    ("max-tokens-0-no-echo", "POST", C, {**OK, "max_tokens": 0}, None, 400, None),
    ("over-context", "POST", C, {**OK, "max_tokens": 2000}, None, 400, "max_tokens"),
    (
        "prompt-over-context",
        "POST",
        C,
        {"prompt": [1] * 1025, "max_tokens": 0, "echo": True},
        None,
        400,
        "prompt",
    ),
    ("temperature-negative", "POST", C, {**OK, "temperature": -0.5}, None, 400, "temperature"),
    ("temperature-high", "POST", C, {**OK, "temperature": 3}, None, 400, "temperature"),
    ("top-p-zero", "POST", C, {**OK, "top_p": 0}, None, 400, "top_p"),
    ("top-p-high", "POST", C, {**OK, "top_p": 1.5}, None, 400, "top_p"),
    ("top-k-negative", "POST", C, {**OK, "top_k": -2}, None, 400, "top_k"),
    ("n-zero", "POST", C, {**OK, "n": 0}, None, 400, "n"),
    ("n-large", "POST", C, {**OK, "n": 17}, None, 400, "n"),
    ("too-many-sequences", "POST", C, {"prompt": ["a"] * 5, "n": 16}, None, 400, "n"),
    ("logprobs-high", "POST", C, {**OK, "logprobs": 21}, None, 400, "logprobs"),
    ("logprobs-negative", "POST", C, {**OK, "logprobs": -1}, None, 400, "logprobs"),
    ("stop-int", "POST", C, {**OK, "stop": 5}, None, 400, "stop"),
    ("stop-list-int", "POST", C, {**OK, "stop": ["a", 3]}, None, 400, None),
    ("seed-too-big", "POST", C, {**OK, "seed": 2**64}, None, 400, "seed"),
    ("seed-string", "POST", C, {**OK, "seed": "x"}, None, 400, "seed"),
    ("stream-string", "POST", C, {**OK, "stream": "yes"}, None, 400, "stream"),
    (
        "stream-options-no-stream",
        "POST",
        C,
        {**OK, "stream_options": {"include_usage": True}},
        None,
        400,
        None,
    ),
    ("suffix", "POST", C, {**OK, "suffix": "x"}, None, 400, None),
    ("best-of", "POST", C, {**OK, "best_of": 3}, None, 400, None),
    ("logit-bias", "POST", C, {**OK, "logit_bias": {"1": 5}}, None, 400, None),
    ("presence-penalty", "POST", C, {**OK, "presence_penalty": 1}, None, 400, None),
    ("chat-no-messages", "POST", CH, {"messages": []}, None, 400, "messages"),
    ("chat-missing-messages", "POST", CH, {"max_tokens": 3}, None, 400, "messages"),
    (
        "chat-bad-role",
        "POST",
        CH,
        {"messages": [{"role": "robot", "content": "x"}]},
        None,
        400,
        None,
    ),
    (
        "chat-image",
        "POST",
        CH,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        None,
        400,
        None,
    ),
    ("chat-top-logprobs-alone", "POST", CH, {"messages": MSG, "top_logprobs": 2}, None, 400, None),
    (
        "chat-max-completion-0",
        "POST",
        CH,
        {"messages": MSG, "max_completion_tokens": 0},
        None,
        400,
        "max_completion_tokens",
    ),
    (
        "chat-over-context",
        "POST",
        CH,
        {"messages": MSG, "max_completion_tokens": 5000},
        None,
        400,
        "max_completion_tokens",
    ),
    ("chat-tools", "POST", CH, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400, None),
    (
        "chat-json-format",
        "POST",
        CH,
        {"messages": MSG, "response_format": {"type": "json_object"}},
        None,
        400,
        None,
    ),
    ("chat-unknown-model", "POST", CH, {"messages": MSG, "model": "x"}, None, 404, "model"),
    ("tokenize-nothing", "POST", "/tokenize", {}, None, 400, None),
    ("detokenize-negative", "POST", "/detokenize", {"tokens": [-1]}, None, 400, "tokens"),
    ("detokenize-oov", "POST", "/detokenize", {"tokens": [10**9]}, None, 400, "tokens"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_gets_the_right_error(http, method, path, body, headers, status, param):
    h = dict(AUTH if headers is None else headers)
    if isinstance(body, bytes):
        resp = http.request(
            method, path, content=body, headers={**h, "content-type": "application/json"}
        )
    elif body is None:
        resp = http.request(method, path, headers=h)
    else:
        resp = http.request(method, path, json=body, headers=h)
    err = _assert_error(resp, status, param)
    if status == 401:
        assert err["code"] == "invalid_api_key"
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"


def test_chunked_body_over_the_limit_is_413(http):
    def body() -> Iterator[bytes]:  # no content-length: the limit is counted while reading
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1000 + 2):
            yield b"a" * 1000
        yield b'"}'

    resp = http.post(C, content=body(), headers={**AUTH, "content-type": "application/json"})
    _assert_error(resp, 413)


def test_health_is_open_and_ok_after_the_bad_inputs(http):
    resp = http.get("/health")  # no key needed
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    good = http.post(C, json=OK, headers=AUTH)
    assert good.status_code == 200 and good.json()["choices"][0]["naf"]["k_x"]


# ---- failures inside the model ---------------------------------------------------------------


class _FailingLM:
    """The real tiny ProtectedLM whose generation fails after ``after`` events (the server's
    error paths are under test, not the model)."""

    def __init__(self, lm: Any, *, after: int) -> None:
        self._lm = lm
        self._after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lm, name)

    def generate_stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for i, ev in enumerate(self._lm.generate_stream(*args, **kwargs)):
            if i >= self._after:
                raise RuntimeError("secret internal detail")
            yield ev


def _sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("after", [0, 2])
def test_model_failure_is_500_or_an_sse_error_event(serve_lm, after):
    from scpdr.serve import Engine, ServeConfig, create_app, serve_in_background

    app = create_app(Engine(_FailingLM(serve_lm, after=after)), ServeConfig(model_name="m"))
    with serve_in_background(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        err = _assert_error(http.post(C, json={"prompt": "Hi", "max_tokens": 4}), 500)
        assert err["type"] == "server_error" and "secret" not in err["message"]
        resp = http.post(C, json={"prompt": "Hi", "max_tokens": 4, "stream": True})
        assert resp.status_code == 200  # the stream had started
        events = _sse_events(resp)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["type"] == "server_error"
        assert "secret" not in error["error"]["message"]
        assert len(events) == 2 + after  # the tokens produced before the failure came first
        chat = http.post(CH, json={"messages": MSG, "max_tokens": 4, "stream": True})
        assert _sse_events(chat)[-1] == "[DONE]" and "error" in _sse_events(chat)[-2]
        assert http.get("/health").json()["status"] == "ok"  # the engine survives


# ---- request ids and the client fingerprint ------------------------------------------------------


def test_every_response_carries_a_request_id(http):
    mine = http.post(C, json=OK, headers={**AUTH, "X-Request-Id": "trace-42"})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
    denied = http.post(C, json=OK)  # rejected by the API key: still identified
    ids = {denied.headers["x-request-id"], http.get("/health").headers["x-request-id"]}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)  # fresh uuid4 hex each
    odd = http.get("/health", headers={"X-Request-Id": "a b\tc"})  # unusable: replaced
    assert odd.headers["x-request-id"] != "a b\tc"
    streamed = http.post(C, json={**OK, "stream": True}, headers={**AUTH, "X-Request-Id": "s-1"})
    assert streamed.headers["x-request-id"] == "s-1"


def test_client_fingerprint_names_a_key_without_revealing_it():
    from scpdr.serve.middleware import key_fingerprint

    fp = key_fingerprint(KEY.encode())
    assert fp == key_fingerprint(KEY.encode()) != key_fingerprint(b"other")
    assert KEY not in fp and len(fp) == 16
