"""Pure ASGI middleware that runs before routing: request ids, the API key, the body size limit.

Outermost first (:func:`add_middleware` installs them in this order):

1. :class:`RequestIdMiddleware`: every response carries ``X-Request-Id`` (the client's, when it
   sent a usable one, else a new one), and ``request.state.request_id`` holds it for logs.
2. :class:`APIKeyMiddleware`: ``Authorization: Bearer KEY`` on every path but ``/health`` (401
   otherwise; constant-time comparison against each accepted key). It records who called in
   ``request.state.client``: a fingerprint of the key, never the key itself. The accountant
   (``serve/budget.py``) keys each client's usage on it.
3. :class:`BodyLimitMiddleware`: bodies over the limit are a 413, also chunked ones that declare
   no length (the body is counted while it is read).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from collections.abc import Sequence
from typing import Any

from scpdr.serve.errors import APIError, send_error

__all__ = [
    "APIKeyMiddleware",
    "BodyLimitMiddleware",
    "RequestIdMiddleware",
    "add_middleware",
    "key_fingerprint",
]

#: Paths answered without the API key.
OPEN_PATHS = frozenset({"/health"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _state(scope: dict[str, Any]) -> dict[str, Any]:
    """The dict behind Starlette's ``request.state`` for this request."""
    return scope.setdefault("state", {})


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v
    return None


def key_fingerprint(key: bytes) -> str:
    """A stable id of an API key that does not reveal it (the first 16 hex digits of its
    SHA-256)."""
    return hashlib.sha256(key).hexdigest()[:16]


class RequestIdMiddleware:
    """``X-Request-Id`` on every response; ``request.state.request_id`` for the routes and logs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        _state(scope)["request_id"] = rid

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """401 without ``Authorization: Bearer <key>`` for one of ``api_keys`` (on every path but
    :data:`OPEN_PATHS`); no keys: every request passes (and has no ``client``)."""

    def __init__(self, app: Any, *, api_keys: Sequence[str] = ()) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys if k]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.api_keys or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        token = token.strip()
        # compare with every key (no early exit): the time does not say which key was close
        known = [hmac.compare_digest(token, key) for key in self.api_keys]
        if scheme.lower() != b"bearer" or not any(known):
            err = APIError(
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )
            await send_error(send, err)
            return
        _state(scope)["client"] = key_fingerprint(token)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes`` (declared or counted while reading)."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than {self.max_bytes} bytes",
            status=413,
            code="request_too_large",
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                await send_error(send, self._too_large())
                return
        # Read the body here (at most max_bytes + one chunk), then replay it to the app: a
        # chunked body without content-length is limited too.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await send_error(send, self._too_large())
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def add_middleware(app: Any, *, api_keys: Sequence[str], max_request_bytes: int) -> None:
    """Install the three on a Starlette/FastAPI ``app`` (the last added runs first)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(RequestIdMiddleware)
