"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (after vLLM's
``create_error_response``), and the FastAPI handlers that turn every failure into one.

| status | when | ``type`` / ``code`` |
|---|---|---|
| 400 | invalid request, including every schema error (FastAPI's 422) | ``invalid_request_error`` |
| 401 | missing or wrong API key | ``invalid_api_key`` |
| 404 | unknown model or route | ``model_not_found`` / ``not_found`` |
| 405 | wrong HTTP method | ``method_not_allowed`` |
| 413 | body over the limit | ``request_too_large`` |
| 429 | the engine's queue is full (``Retry-After: 1``) | ``requests`` / ``rate_limit_exceeded`` |
| 429 | the API key's budget is spent (``serve/budget.py``) | ``insufficient_quota`` / ``budget_exceeded`` |
| 500 | anything unexpected (the message names no internals) | ``server_error`` / ``internal_error`` |
| 503 | the engine is shutting down | ``server_error`` / ``unavailable`` |
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scpdr.errors import ScpdrError
from scpdr.serve.engine import EngineOverloadedError, EngineStoppedError
from scpdr.serve.protocol import ErrorBody, ErrorResponse

__all__ = [
    "APIError",
    "from_engine_error",
    "install_error_handlers",
    "internal_error",
    "send_error",
    "validation_message",
]

logger = logging.getLogger(__name__)


class APIError(ScpdrError):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.status == 429 else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers() or None)


def internal_error() -> APIError:
    """A 500 whose message names no internals (the log has the traceback)."""
    return APIError(
        "the server failed to process the request; see its log",
        status=500,
        type="server_error",
        code="internal_error",
    )


def from_engine_error(exc: BaseException) -> APIError:
    """The API error of an engine failure: 429 when its queue is full, 503 when it stops,
    otherwise a 500 that names no internals."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), status=429, type="requests", code="rate_limit_exceeded")
    if isinstance(exc, EngineStoppedError):
        return APIError(str(exc), status=503, type="server_error", code="unavailable")
    return internal_error()


async def send_error(send: Any, err: APIError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``err`` from pure ASGI middleware (before FastAPI's handlers exist)."""
    body = json.dumps(err.body()).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# pydantic names the union branch it tried in an error's location ('list[int]', 'str', ...)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A schema error as one message and the ``param`` it is about (its first problem)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in loc if not _UNION_TAG.match(p)]  # drop pydantic's union-branch names
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {msg}", None
    if loc[:1] == ["prompt"] and first.get("type") != "missing":
        return (
            "prompt: must be a string, a list of strings, a list of token ids (ints) or a list "
            "of token-id lists",
            "prompt",
        )
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}{msg}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of ``app`` answered in OpenAI's shape: API errors with their status, schema
    errors as 400 (not FastAPI's 422), routing errors as 404/405, anything else as a 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return APIError(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(str(exc.detail), status=exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        logger.exception("request %s failed", rid, exc_info=exc)
        return internal_error().response()
