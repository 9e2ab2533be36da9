"""The routes: an OpenAI-compatible FastAPI app over an :class:`~scpdr.serve.engine.Engine`
(STYLE.md 10, after vLLM ``entrypoints/openai/api_server.py``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(``/v1/models/{id}``), ``GET /health``, and vLLM's tokenizer endpoints that lm-evaluation-harness's
``RemoteTokenizer`` calls: ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``.

Every request is validated (pydantic models of :mod:`scpdr.serve.protocol`, then token ids,
vocabulary and context length) before it reaches the engine, so bad input is a 400 and never a
500. Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 (invalid
request, including FastAPI's validation errors, which would otherwise be 422), 401 (missing or
wrong API key), 404 (unknown model or route), 413 (body over the size limit), 429 (queue full),
500 (anything unexpected; the message names no internals), 503 (shutting down). An error after a
stream has started is sent as an SSE ``data: {"error": ...}`` event, then ``data: [DONE]``.

Only the aggregate distribution r(·|x) of the protected model is ever serialized (the paper's
black-box threat model, Definition 4.1); every choice carries the ``naf`` certificate
(:class:`~scpdr.serve.protocol.NafCertificate`).
"""

from __future__ import annotations

import codecs
import contextlib
import copy
import functools
import hmac
import json
import logging
import re
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from scpdr.errors import ScpdrError
from scpdr.serve import protocol as P
from scpdr.serve.engine import (
    Engine,
    EngineOverloadedError,
    EngineStoppedError,
    Failed,
    Finished,
    PromptLogprobs,
    SamplingParams,
    TokenOutput,
)

__all__ = ["APIError", "ServeConfig", "create_app", "serve_in_background"]

logger = logging.getLogger(__name__)

_INT64 = 2**63


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
        return P.ErrorResponse(
            error=P.ErrorBody(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        ).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _overloaded(exc: Exception) -> APIError:
    return APIError(str(exc), status=429, type="requests", code="rate_limit_exceeded")


def _stopped(exc: Exception) -> APIError:
    return APIError(str(exc), status=503, type="server_error", code="unavailable")


def _internal() -> APIError:
    return APIError(
        "the server failed to process the request; see its log",
        status=500,
        type="server_error",
        code="internal_error",
    )


@dataclass
class ServeConfig:
    """Settings of the HTTP layer (the engine's own are on :class:`Engine`)."""

    model_name: str = field(default="scpdr", metadata={"help": "The id served in /v1/models."})
    api_key: str | None = field(default=None, metadata={"help": "Bearer key; None = open."})
    max_request_bytes: int = field(
        default=2 * 1024 * 1024, metadata={"help": "Largest accepted request body (413 above)."}
    )
    max_sequences_per_request: int = field(
        default=64, metadata={"help": "Most prompts × n in one request (400 above)."}
    )

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_sequences_per_request < 1:
            raise ValueError("max_sequences_per_request must be >= 1")


# ------------------------------------------------------------------------------------------------
# Tokens as text and bytes
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (byte-level BPE: each char stands for one byte)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Per-token strings and bytes for log-prob payloads (cached; its own tokenizer copy)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)
        self.str = functools.lru_cache(maxsize=65536)(self._str)

    def _bytes(self, token_id: int) -> bytes:
        with self._lock:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            if piece is None:
                return b""
            dec = _byte_decoder()
            if all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
            return self.tokenizer.decode([int(token_id)]).encode("utf-8")

    def _str(self, token_id: int) -> str:
        """The token's text; a token that is not valid UTF-8 on its own is ``bytes:\\xNN...``
        (OpenAI's convention), so distinct tokens keep distinct keys."""
        b = self.bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def offsets(self, token_ids: Sequence[int], *, start: int = 0) -> list[int]:
        """Character offset of each token in the decoded text of ``token_ids`` (plus ``start``)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, pos = [], start
        for t in token_ids:
            out.append(pos)
            pos += len(decoder.decode(self.bytes(t)))
        return out


# ------------------------------------------------------------------------------------------------
# The serving state
# ------------------------------------------------------------------------------------------------


def _context_length(lm: Any) -> int:
    """Most tokens (prompt + completion) the protected model takes: the smallest
    ``max_position_embeddings`` of the models it runs."""
    for attr in ("max_length", "context_length"):
        v = getattr(lm, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    models = [*getattr(lm, "constituents", []), getattr(lm, "base_model", None)]
    sizes = [
        getattr(getattr(mdl, "config", None), "max_position_embeddings", None) for mdl in models
    ]
    sizes = [v for v in sizes if isinstance(v, int) and v > 0]
    if sizes:
        return min(sizes)
    tok_max = getattr(lm.tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 10**7:
        return tok_max
    return 2048


class ServingState:
    """What the routes need: the engine, a front-end tokenizer copy, limits and model facts."""

    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        lm = engine.lm
        self.engine = engine
        self.config = config
        # The worker thread uses lm.tokenizer; a fast tokenizer is not safe to share across
        # threads, so the HTTP side has its own copy.
        self.tokenizer = copy.deepcopy(lm.tokenizer)
        self.text = TokenText(copy.deepcopy(lm.tokenizer))
        self.vocab_size = int(lm.vocab_size)
        self.context_length = _context_length(lm)
        self.method = str(lm.method)
        self.m = int(lm.m) if str(lm.method).startswith("scp") and lm.m is not None else None
        self.name = str(getattr(lm, "name", lm.method))
        self.num_constituents = int(getattr(lm, "num_constituents", 0) or 0)
        self.created = P.now()

    # ---- validation ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"`{self.config.model_name}` (GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_ids(self, ids: Sequence[int], *, param: str = "prompt") -> None:
        if not ids:
            raise APIError("the prompt is empty: send at least one token", param=param)
        for t in ids:
            if t < 0 or t >= self.vocab_size:
                raise APIError(
                    f"token id {t} is out of the vocabulary [0, {self.vocab_size})",
                    param=param,
                    code="invalid_token_id",
                )

    def max_new_tokens(self, prompt_len: int, requested: int | None, *, param: str) -> int:
        room = self.context_length - prompt_len
        if room < 0 or (room == 0 and requested != 0):
            raise APIError(
                f"the prompt has {prompt_len} tokens, more than the context allows "
                f"({self.context_length} tokens including the completion); shorten it",
                param="prompt" if param == "max_tokens" else "messages",
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if prompt_len + requested > self.context_length:
            raise APIError(
                f"prompt ({prompt_len} tokens) + {param} ({requested}) exceeds the context "
                f"length {self.context_length}; lower {param} or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def check_sequences(self, count: int) -> None:
        limit = min(self.config.max_sequences_per_request, self.engine.max_queue)
        if count > limit:
            raise APIError(
                f"the request asks for {count} sequences (prompts × n); at most {limit}",
                param="n",
            )

    # ---- certificates and log-probs --------------------------------------------------------

    def certificate(
        self,
        tokens: Sequence[TokenOutput],
        prompt: PromptLogprobs | None = None,
        *,
        listed: slice | None = None,
        list_prompt: bool = True,
    ) -> P.NafCertificate:
        """The ``naf`` object of a choice whose completion so far is ``tokens``; ``listed``
        restricts the per-token lists (streaming), the maxima cover every token."""
        return P.NafCertificate.build(
            method=self.method,
            m=self.m,
            name=self.name,
            k_x=[t.k_x for t in tokens],
            t_x=[t.t_x for t in tokens],
            prompt_k_x=None if prompt is None else [None, *prompt.k_x],
            prompt_t_x=None if prompt is None else [None, *prompt.t_x],
            listed=listed,
            list_prompt=list_prompt,
        )

    def top_dict(
        self, top: Sequence[tuple[int, float]], k: int, chosen: int, chosen_lp: float
    ) -> dict[str, float]:
        """Legacy ``top_logprobs`` entry: the ``k`` best alternatives plus the chosen token."""
        d = {self.text.str(t): P.logprob_value(lp) for t, lp in list(top)[:k]}
        d[self.text.str(chosen)] = P.logprob_value(chosen_lp)
        return d


def seed_for(seed: int | None, choice: int) -> int | None:
    """Choice ``j`` of a prompt samples with ``seed + j`` (wrapped into int64)."""
    if seed is None:
        return None
    return (seed + choice + _INT64) % (2 * _INT64) - _INT64


# ------------------------------------------------------------------------------------------------
# Collecting engine events into choices
# ------------------------------------------------------------------------------------------------


@dataclass
class _Choice:
    prompt_text: str
    prompt_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    tokens: list[TokenOutput] = field(default_factory=list)
    tail: str = ""
    finish_reason: str | None = None

    @property
    def completion_text(self) -> str:
        return "".join(t.text for t in self.tokens) + self.tail


def _apply(choice: _Choice, event: Any) -> None:
    if isinstance(event, PromptLogprobs):
        choice.prompt_logprobs = event
    elif isinstance(event, TokenOutput):
        choice.tokens.append(event)
    elif isinstance(event, Finished):
        choice.tail += event.text
        choice.finish_reason = event.finish_reason


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineStoppedError):
        return _stopped(exc)
    if isinstance(exc, EngineOverloadedError):
        return _overloaded(exc)
    return _internal()


async def _events(stream: Any) -> AsyncIterator[tuple[int, Any]]:
    """The engine's ``(choice index, event)`` pairs; a ``Failed`` event cancels the stream and
    raises its :class:`APIError`, so every endpoint answers an engine failure alike."""
    async for index, event in stream.events():
        if isinstance(event, Failed):
            stream.cancel()
            raise _engine_error(event.error)
        yield index, event


async def _collect(stream: Any, choices: list[_Choice]) -> None:
    async for index, event in _events(stream):
        _apply(choices[index], event)


def _submit(state: ServingState, seqs: list[tuple[list[int], SamplingParams]]) -> Any:
    try:
        return state.engine.submit(seqs)
    except EngineOverloadedError as exc:
        raise _overloaded(exc) from exc
    except EngineStoppedError as exc:
        raise _stopped(exc) from exc


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(choices: Sequence[_Choice], n: int) -> P.Usage:
    prompt = sum(len(c.prompt_ids) for c in choices[::n])
    completion = sum(len(c.tokens) for c in choices)
    return P.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


_DONE = "data: [DONE]\n\n"

_GenerationRequest = P.CompletionRequest | P.ChatCompletionRequest
_Inputs = tuple[list[_Choice], list[tuple[list[int], SamplingParams]]]


@dataclass
class _Run:
    """A generation request submitted to the engine: its event stream, its choices (filled in
    from the events), and the id and creation time of its response."""

    stream: Any
    choices: list[_Choice]
    rid: str
    created: int


async def _sse_stream(
    state: ServingState,
    req: _GenerationRequest,
    run: _Run,
    *,
    body: AsyncIterator[str],
    chunk_type: type[P.CompletionChunk] | type[P.ChatCompletionChunk],
) -> AsyncIterator[str]:
    """Frame a streamed response: ``body``'s events, the usage event if the request asked for it,
    then ``[DONE]``. An engine failure, or any error once the stream has started, is sent as an
    SSE error event before ``[DONE]``; the engine stream is cancelled however it ends."""
    stream, choices, rid, created = run.stream, run.choices, run.rid, run.created
    try:
        async for data in body:
            yield data
        if req.include_usage_in_stream():
            usage = _usage(choices, req.n)
            yield _sse(
                chunk_type(
                    id=rid, created=created, model=state.config.model_name, choices=[], usage=usage
                )
            )
        yield _DONE
    except APIError as exc:  # raised by _events only: the stream's helpers raise no APIError
        yield _sse(exc.body())
        yield _DONE
    except Exception:  # an error after the stream started: SSE error event, then [DONE]
        logger.exception("streamed response %s failed", rid)
        stream.cancel()
        yield _sse(_internal().body())
        yield _DONE
    finally:
        stream.cancel()


@dataclass(frozen=True)
class _Endpoint:
    """What differs between the generation endpoints; :func:`_respond` is what they share."""

    inputs: Callable[[ServingState, Any], _Inputs]  # validated choices and engine sequences
    id_prefix: str  # of the response id
    stream_body: Callable[[ServingState, Any, _Run], AsyncIterator[str]]  # SSE events
    chunk_type: type[P.CompletionChunk] | type[P.ChatCompletionChunk]  # of the usage event
    build: Callable[[ServingState, Any, _Run], BaseModel]  # once every choice is collected


async def _respond(state: ServingState, req: _GenerationRequest, endpoint: _Endpoint) -> Response:
    """The one flow of both generation endpoints: validate, submit to the engine, then stream the
    endpoint's SSE events or collect every choice and answer the endpoint's response."""
    state.check_model(req.model)
    choices, seqs = endpoint.inputs(state, req)
    rid, created = P.new_id(endpoint.id_prefix), P.now()
    run = _Run(_submit(state, seqs), choices, rid, created)
    if req.stream:
        body = endpoint.stream_body(state, req, run)
        events = _sse_stream(state, req, run, body=body, chunk_type=endpoint.chunk_type)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
    try:
        await _collect(run.stream, choices)
    finally:
        run.stream.cancel()
    return _json(endpoint.build(state, req, run))


def _add_choices(
    choices: list[_Choice],
    seqs: list[tuple[list[int], SamplingParams]],
    req: _GenerationRequest,
    text: str,
    ids: list[int],
    *,
    max_new: int,
    logprobs: int | None,
    echo_logprobs: bool = False,
) -> None:
    """Append the ``req.n`` choices of one prompt (``ids``, shown as ``text``) and their engine
    sequences; choice ``j`` samples with ``seed_for(req.seed, j)``."""
    stop = tuple(req.stop_list())
    for j in range(req.n):
        params = SamplingParams(
            max_tokens=max_new,
            temperature=req.effective_temperature(),
            top_p=req.effective_top_p(),
            top_k=req.effective_top_k(),
            stop=stop,
            seed=seed_for(req.seed, j),
            logprobs=logprobs,
            echo_logprobs=echo_logprobs,
        )
        choices.append(_Choice(prompt_text=text, prompt_ids=ids))
        seqs.append((ids, params))


# ------------------------------------------------------------------------------------------------
# /v1/completions
# ------------------------------------------------------------------------------------------------


def _completion_inputs(state: ServingState, req: P.CompletionRequest) -> _Inputs:
    try:
        prompts = req.prompts()
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from exc
    state.check_sequences(len(prompts) * req.n)
    choices: list[_Choice] = []
    seqs: list[tuple[list[int], SamplingParams]] = []
    for p in prompts:
        if isinstance(p, str):
            ids = state.encode(p, add_special_tokens=True)
            text = p
        else:
            ids = list(p)  # used exactly as given: no BOS added
            text = ""  # decoded below, only for echo
        state.check_ids(ids)
        max_new = state.max_new_tokens(len(ids), req.max_tokens, param="max_tokens")
        if req.echo and not text:
            text = state.tokenizer.decode(ids)
        _add_choices(
            choices,
            seqs,
            req,
            text,
            ids,
            max_new=max_new,
            logprobs=req.logprobs,
            echo_logprobs=req.echo and req.logprobs is not None,
        )
    return choices, seqs


def _completion_logprobs(
    state: ServingState,
    choice: _Choice,
    tokens: Sequence[TokenOutput],
    *,
    k: int,
    echo_prompt: bool,
    start: int = 0,
) -> P.CompletionLogprobs:
    ids: list[int] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echo_prompt:
        pl = choice.prompt_logprobs
        for i, t in enumerate(choice.prompt_ids):
            ids.append(t)
            if i == 0 or pl is None:
                token_lps.append(None)
                tops.append(None)
            else:
                lp = pl.token_logprobs[i - 1]
                token_lps.append(P.logprob_value(lp))
                tops.append(state.top_dict(pl.top_logprobs[i - 1], k, t, lp))
    for tok in tokens:
        ids.append(tok.token_id)
        token_lps.append(P.logprob_value(tok.logprob))
        tops.append(state.top_dict(tok.top_logprobs, k, tok.token_id, tok.logprob))
    return P.CompletionLogprobs(
        tokens=[state.text.str(t) for t in ids],
        token_logprobs=token_lps,
        top_logprobs=tops,
        text_offset=state.text.offsets(ids, start=start),
    )


def _completion_choice(
    state: ServingState, req: P.CompletionRequest, index: int, choice: _Choice
) -> P.CompletionChoice:
    text = (choice.prompt_text if req.echo else "") + choice.completion_text
    logprobs = None
    if req.logprobs is not None:
        logprobs = _completion_logprobs(
            state, choice, choice.tokens, k=req.logprobs, echo_prompt=req.echo
        )
    return P.CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]
        naf=state.certificate(choice.tokens, choice.prompt_logprobs),
    )


async def _stream_completion(
    state: ServingState, req: P.CompletionRequest, run: _Run
) -> AsyncIterator[str]:
    choices, rid, created = run.choices, run.rid, run.created
    model = state.config.model_name
    started = [False] * len(choices)
    offsets = [0] * len(choices)

    def chunk(
        i: int,
        text: str,
        logprobs: P.CompletionLogprobs | None,
        finish: str | None,
        listed: slice,
        list_prompt: bool = False,
    ) -> P.CompletionChunk:
        c = choices[i]
        naf = state.certificate(c.tokens, c.prompt_logprobs, listed=listed, list_prompt=list_prompt)
        return P.CompletionChunk(
            id=rid,
            created=created,
            model=model,
            choices=[
                P.CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,  # type: ignore[arg-type]
                    naf=naf,
                )
            ],
        )

    none = slice(0, 0)
    async for i, event in _events(run.stream):
        c = choices[i]
        if isinstance(event, PromptLogprobs):  # sent with the echo chunk
            _apply(c, event)
            continue
        if not started[i] and req.echo:  # the echoed prompt comes first
            started[i] = True
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(state, c, [], k=req.logprobs, echo_prompt=True)
            offsets[i] = len(c.prompt_text)
            yield _sse(chunk(i, c.prompt_text, lp, None, none, list_prompt=True))
        _apply(c, event)
        if isinstance(event, TokenOutput):
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(
                    state, c, [event], k=req.logprobs, echo_prompt=False, start=offsets[i]
                )
            offsets[i] += len(event.text)
            n = len(c.tokens)
            yield _sse(chunk(i, event.text, lp, None, slice(n - 1, n)))
        elif isinstance(event, Finished):
            yield _sse(chunk(i, event.text, None, event.finish_reason, none))


def _completion_response(
    state: ServingState, req: P.CompletionRequest, run: _Run
) -> P.CompletionResponse:
    return P.CompletionResponse(
        id=run.rid,
        created=run.created,
        model=state.config.model_name,
        choices=[_completion_choice(state, req, i, c) for i, c in enumerate(run.choices)],
        usage=_usage(run.choices, req.n),
    )


# ------------------------------------------------------------------------------------------------
# /v1/chat/completions
# ------------------------------------------------------------------------------------------------


def _chat_prompt(state: ServingState, messages: Sequence[P.ChatMessage], *, gen: bool) -> str:
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(
            "this model's tokenizer has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    conv = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        return state.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    except Exception as exc:  # jinja raises for conversations the template rejects
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from exc


def _chat_logprobs(state: ServingState, tokens: Sequence[TokenOutput], k: int) -> P.ChatLogprobs:
    content = []
    for t in tokens:
        content.append(
            P.ChatTokenLogprob(
                token=state.text.str(t.token_id),
                logprob=P.logprob_value(t.logprob),
                bytes=list(state.text.bytes(t.token_id)),
                top_logprobs=[
                    P.TopLogprob(
                        token=state.text.str(a),
                        logprob=P.logprob_value(lp),
                        bytes=list(state.text.bytes(a)),
                    )
                    for a, lp in list(t.top_logprobs)[:k]
                ],
            )
        )
    return P.ChatLogprobs(content=content)


def _chat_inputs(state: ServingState, req: P.ChatCompletionRequest) -> _Inputs:
    state.check_sequences(req.n)
    text = _chat_prompt(state, req.messages, gen=True)
    ids = state.encode(text, add_special_tokens=False)
    state.check_ids(ids, param="messages")
    max_new = state.max_new_tokens(len(ids), req.max_new_tokens(), param="max_completion_tokens")
    top = (req.top_logprobs or 0) if req.logprobs else None
    choices: list[_Choice] = []
    seqs: list[tuple[list[int], SamplingParams]] = []
    _add_choices(choices, seqs, req, text, ids, max_new=max_new, logprobs=top)
    return choices, seqs


async def _stream_chat(
    state: ServingState, req: P.ChatCompletionRequest, run: _Run
) -> AsyncIterator[str]:
    choices, rid, created = run.choices, run.rid, run.created
    model = state.config.model_name
    k = req.top_logprobs or 0

    def chunk(i: int, delta: P.DeltaMessage, **kw: Any) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=rid,
            created=created,
            model=model,
            choices=[P.ChatChunkChoice(index=i, delta=delta, **kw)],
        )

    for i in range(len(choices)):  # the role comes first, in its own delta
        yield _sse(chunk(i, P.DeltaMessage(role="assistant", content="")))
    async for i, event in _events(run.stream):
        _apply(choices[i], event)
        n = len(choices[i].tokens)
        if isinstance(event, TokenOutput):
            yield _sse(
                chunk(
                    i,
                    P.DeltaMessage(content=event.text),
                    logprobs=_chat_logprobs(state, [event], k) if req.logprobs else None,
                    naf=state.certificate(choices[i].tokens, listed=slice(n - 1, n)),
                )
            )
        elif isinstance(event, Finished):
            yield _sse(
                chunk(
                    i,
                    P.DeltaMessage(content=event.text or None),
                    finish_reason=event.finish_reason,
                    naf=state.certificate(choices[i].tokens, listed=slice(n, n)),
                )
            )


def _chat_response(
    state: ServingState, req: P.ChatCompletionRequest, run: _Run
) -> P.ChatCompletionResponse:
    k = req.top_logprobs or 0
    return P.ChatCompletionResponse(
        id=run.rid,
        created=run.created,
        model=state.config.model_name,
        choices=[
            P.ChatChoice(
                index=i,
                message=P.AssistantMessage(content=c.completion_text),
                logprobs=_chat_logprobs(state, c.tokens, k) if req.logprobs else None,
                finish_reason=c.finish_reason,  # type: ignore[arg-type]
                naf=state.certificate(c.tokens),
            )
            for i, c in enumerate(run.choices)
        ],
        usage=_usage(run.choices, req.n),
    )


# (inputs, id prefix, stream body, usage chunk type, response): the fields of _Endpoint
_COMPLETIONS = _Endpoint(
    _completion_inputs, "cmpl", _stream_completion, P.CompletionChunk, _completion_response
)
_CHAT_COMPLETIONS = _Endpoint(
    _chat_inputs, "chatcmpl", _stream_chat, P.ChatCompletionChunk, _chat_response
)


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------


class _Guard:
    """Pure ASGI middleware, before routing: the API key (401) and the body size limit (413)."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: Any, *, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    @staticmethod
    async def _send(send: Any, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in self.OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await self._send(
                    send,
                    APIError(
                        "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                        status=401,
                        code="invalid_api_key",
                    ),
                )
                return
        too_large = APIError(
            f"the request body is larger than {self.max_bytes} bytes",
            status=413,
            code="request_too_large",
        )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                await self._send(send, too_large)
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
                await self._send(send, too_large)
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


# pydantic names the union branch it tried in an error's location ('list[int]', 'str', ...)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # drop pydantic's union-branch names (e.g. 'list[int]') from the location
    loc = [p for p in loc if not _UNION_TAG.match(p)]
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


def create_app(engine: Engine, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app for ``engine``; the app's lifespan starts and stops the engine."""
    config = config or ServeConfig()
    state = ServingState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(
        title="scpdr",
        description="OpenAI-compatible API of an SCP-Δr protected model",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serving = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(str(exc.detail), status=exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=exc)
        return _internal().response()

    @app.get("/health")
    async def health() -> Response:
        ok = engine.alive
        body = {"status": "ok" if ok else "unavailable", **engine.stats()}
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> P.ModelCard:
        return P.ModelCard(
            id=config.model_name,
            created=state.created,
            max_model_len=state.context_length,
            naf={
                "method": state.method,
                "m": state.m,
                "name": state.name,
                "num_constituents": state.num_constituents,
            },
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(P.ModelList(data=[model_card()]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        state.check_model(model_id)
        return _json(model_card())

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest) -> Response:
        return await _respond(state, req, _COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest) -> Response:
        return await _respond(state, req, _CHAT_COMPLETIONS)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        tok = state.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": type(tok).__name__,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "pad_token": tok.pad_token,
                "unk_token": tok.unk_token,
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": state.context_length,
                "vocab_size": state.vocab_size,
            }
        )

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> Response:
        state.check_model(req.model)
        if req.messages is not None:
            text = _chat_prompt(state, req.messages, gen=req.add_generation_prompt)
            ids = state.encode(text, add_special_tokens=False)
        else:
            ids = state.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": state.context_length,
                "tokens": ids,
                "token_strs": [state.text.str(t) for t in ids],
            }
        )

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> Response:
        state.check_model(req.model)
        for t in req.tokens:
            if t >= state.vocab_size:
                raise APIError(
                    f"token id {t} is out of the vocabulary [0, {state.vocab_size})",
                    param="tokens",
                    code="invalid_token_id",
                )
        return JSONResponse({"prompt": state.tokenizer.decode(req.tokens)})

    app.add_middleware(_Guard, api_key=config.api_key, max_bytes=config.max_request_bytes)
    return app


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_in_background(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread; yield its base URL (``http://host:port``).

    ``port=0`` binds a free port (the socket is bound before the thread starts, so there is no
    race). The server (and, through the lifespan, the engine) stops when the block exits.
    """
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start; see the log")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
