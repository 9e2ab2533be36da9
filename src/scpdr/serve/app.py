"""The FastAPI app: its factory and routes (after vLLM's ``entrypoints/openai/api_server.py``).

Endpoints: ``POST /v1/completions`` (:mod:`~scpdr.serve.completions`), ``POST /v1/chat/completions``
(:mod:`~scpdr.serve.chat`), ``GET /v1/models`` (``/v1/models/{id}``), ``GET /v1/budget`` (the
caller's balance, :mod:`~scpdr.serve.budget`), ``GET /health``, and vLLM's
tokenizer endpoints that lm-evaluation-harness's ``RemoteTokenizer`` calls: ``GET
/tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``.

Every request is validated (the pydantic models of :mod:`~scpdr.serve.protocol`, then token ids,
vocabulary and context length) before it reaches the engine, so bad input is a 400 and never a
500; every failure has OpenAI's error shape (:mod:`~scpdr.serve.errors`). Auth, request ids and
the body limit are middleware (:mod:`~scpdr.serve.middleware`). Only the aggregate distribution
r(·|x) of the protected model is ever serialized (the paper's black-box TDE game, Definition 4.2);
every choice carries the ``naf`` object (:mod:`~scpdr.serve.certificate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from scpdr.serve.chat import ChatEndpoint, chat_prompt
from scpdr.serve.completions import CompletionEndpoint
from scpdr.serve.config import ServeConfig
from scpdr.serve.engine import Engine
from scpdr.serve.errors import install_error_handlers
from scpdr.serve.middleware import add_middleware
from scpdr.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from scpdr.serve.serving import ServingState, json_response

__all__ = ["create_app"]


def create_app(engine: Engine, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app for ``engine``; the app's lifespan starts and stops the engine.

    ``config`` supplies the API's settings (model id, API key, limits); its engine settings are
    the ones :meth:`Engine.from_config` reads, so pass it there too.
    """
    config = config or ServeConfig()
    config.check_protection(str(engine.lm.method))  # "none" only with unprotected, and logged
    state = ServingState(engine, config)
    completion = CompletionEndpoint(state)
    chat = ChatEndpoint(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            state.accountant.close()

    app = FastAPI(
        title="scpdr",
        description="OpenAI-compatible API of an SCP-Δr protected model",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serving = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        ok = engine.alive
        body = {"status": "ok" if ok else "unavailable", **engine.stats()}
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> ModelCard:
        return ModelCard(
            id=state.model_name,
            created=state.created,
            max_model_len=state.context_length,
            naf={
                "method": state.method,
                "m": state.m,
                "name": state.name,
                "num_constituents": state.num_constituents,
                "budget": config.budget,
                "client_budget": config.client_budget,
                "budget_window_s": config.budget_window,
            },
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=[model_card()]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        state.check_model(model_id)
        return json_response(model_card())

    def client(request: Request) -> str | None:
        """The caller: the API-key middleware's fingerprint of its key (None without keys)."""
        return getattr(request.state, "client", None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await completion.respond(req, client(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await chat.respond(req, client(request))

    @app.get("/v1/budget")
    async def budget(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(state.accountant.balance, client(request)))

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
    async def tokenize(req: TokenizeRequest) -> Response:
        state.check_model(req.model)
        if req.messages is not None:
            text = chat_prompt(state, req.messages, gen=req.add_generation_prompt)
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
    async def detokenize(req: DetokenizeRequest) -> Response:
        state.check_model(req.model)
        state.check_ids(req.tokens, param="tokens", empty=True)
        return JSONResponse({"prompt": state.tokenizer.decode(req.tokens)})

    add_middleware(app, api_keys=config.api_keys, max_request_bytes=config.max_request_bytes)
    return app
