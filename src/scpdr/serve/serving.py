"""What both generation endpoints share (after vLLM's ``entrypoints/openai/serving_engine.py``):
the serving state (model facts, a front-end tokenizer, request validation, the ``naf`` object) and
:class:`GenerationEndpoint`, the one flow of ``/v1/completions`` and ``/v1/chat/completions``:
validate, build one :class:`~scpdr.runtime.sampling.SamplingParams` per prompt and choice, give each
its budget (the accountant, :mod:`~scpdr.serve.budget`: the per-response budget and the caller's
share of its client budget, reserved), submit to the engine, then stream the endpoint's SSE events
or collect every choice into its response, and settle the caller's charge to what it was served.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from scpdr import methods
from scpdr.errors import ConfigError
from scpdr.runtime.sampling import SamplingParams
from scpdr.serve.budget import Accountant, Allotment
from scpdr.serve.certificate import build_certificate
from scpdr.serve.config import ServeConfig
from scpdr.serve.engine import (
    Engine,
    EngineOverloadedError,
    EngineStoppedError,
    Failed,
    Finished,
    PromptLogprobs,
    RequestStream,
    TokenOutput,
)
from scpdr.serve.errors import APIError, from_engine_error, internal_error
from scpdr.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    NafCertificate,
    Usage,
)
from scpdr.serve.tokens import TokenText

__all__ = ["Choice", "GenerationEndpoint", "Run", "ServingState", "json_response", "sse"]

logger = logging.getLogger(__name__)

GenerationRequest = CompletionRequest | ChatCompletionRequest
Sequences = list[tuple[list[int], SamplingParams]]


def context_length(lm: Any) -> int:
    """Most tokens (prompt + completion) the protected model takes: ``lm.context_length`` (the
    smallest ``max_position_embeddings`` of the models it runs, else the tokenizer's limit), or
    2048 when it is unknown."""
    n = getattr(lm, "context_length", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 2048


class ServingState:
    """What the routes need: the engine, a front-end tokenizer copy, limits and model facts."""

    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        lm = engine.lm
        self.engine = engine
        self.config = config
        #: The budgets (per response, per client) and the clients' usage file.
        self.accountant = Accountant.from_config(config)
        self.model_name = config.served_model_name
        # The worker thread uses lm.tokenizer; a fast tokenizer is not safe to share across
        # threads, so the HTTP side has its own copies.
        self.tokenizer = copy.deepcopy(lm.tokenizer)
        self.text = TokenText(copy.deepcopy(lm.tokenizer))
        self.vocab_size = int(lm.vocab_size)
        self.context_length = context_length(lm)
        self.method = str(lm.method)
        smoothed = self.method in methods.SMOOTHED_RULES and lm.m is not None
        self.m = int(lm.m) if smoothed else None
        self.name = str(getattr(lm, "name", lm.method))
        self.num_constituents = int(getattr(lm, "num_constituents", 0) or 0)
        self.created = int(time.time())
        if (config.on_budget == "base" or config.anchor is not None) and getattr(
            lm, "variant", None
        ) != "b":
            what = "--on-budget base" if config.on_budget == "base" else "--anchor"
            raise ConfigError(
                f"{what} serves from the base model's next-token distribution, and {self.name} "
                "runs no base model: serve an SCP method with --base model (variant 'b')"
            )

    # ---- validation ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"`{self.model_name}` (GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_ids(self, ids: Sequence[int], *, param: str = "prompt", empty: bool = False) -> None:
        """Token ids in the vocabulary (and, unless ``empty``, at least one)."""
        if not ids and not empty:
            raise APIError("the prompt is empty: send at least one token", param=param)
        for t in ids:
            if t < 0 or t >= self.vocab_size:
                raise APIError(
                    f"token id {t} is out of the vocabulary [0, {self.vocab_size})",
                    param=param,
                    code="invalid_token_id",
                )

    def max_new_tokens(self, prompt_len: int, requested: int | None, *, param: str) -> int:
        """``requested`` checked against the context, or the room left in it when ``None``."""
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

    # ---- the naf object ----------------------------------------------------------------------

    def certificate(
        self,
        tokens: Sequence[TokenOutput],
        prompt: PromptLogprobs | None = None,
        *,
        budget: float | None = None,
        listed: slice | None = None,
        list_prompt: bool = True,
    ) -> NafCertificate:
        """The ``naf`` object of a choice whose completion so far is ``tokens`` (held to
        ``budget``); ``listed`` restricts the per-token lists (streaming), the maxima and sums
        cover every token; the charges against the base and the fallback come with the tokens
        (``TokenOutput.anchor``/``.fallback``)."""
        anchor = [t.anchor for t in tokens]
        prompt_anchor = None if prompt is None or not prompt.anchor else [None, *prompt.anchor]
        measured = any(a is not None for a in anchor) or prompt_anchor is not None
        fallback_at = private = None
        if self.config.on_budget == "base":
            fell = [i for i, t in enumerate(tokens) if t.fallback]
            if prompt is not None and prompt.fallback_at is not None:
                fell = [0]
            fallback_at = fell[0] if fell else None
            private = len(tokens) if fallback_at is None else fallback_at
        return build_certificate(
            method=self.method,
            m=self.m,
            name=self.name,
            k_x=[t.k_x for t in tokens],
            t_x=[t.t_x for t in tokens],
            cost=[t.cost for t in tokens],
            prompt_k_x=None if prompt is None else [None, *prompt.k_x],
            prompt_t_x=None if prompt is None else [None, *prompt.t_x],
            prompt_cost=None if prompt is None else [None, *prompt.cost],
            budget=budget,
            listed=listed,
            list_prompt=list_prompt,
            anchor=anchor if measured else None,
            prompt_anchor=prompt_anchor,
            fallback_at=fallback_at,
            private_tokens=private,
        )


# ------------------------------------------------------------------------------------------------
# Choices, filled in from engine events
# ------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice of a response: its prompt and what the engine has sent for it so far."""

    prompt_text: str
    prompt_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    tokens: list[TokenOutput] = field(default_factory=list)
    tail: str = ""
    finish_reason: str | None = None
    budget: float | None = None  # nats this choice may be charged (None: no budget)

    @property
    def charged(self) -> float:
        """What the client is charged for the choice: the charges of its tokens and served
        prompt positions (``naf.sum_cost``); a choice its budget stopped is charged its whole
        budget (the stop itself told the client that the next token costs more than was left,
        and the client's balance then reaches 0 exactly: a 429, not empty responses). A choice
        that fell back to the base (``--on-budget base``) is charged its ``sum_cost``: its base
        tokens cost 0 and the switch was decided before any draw (``docs/accountant.md``,
        Proposition 3)."""
        echoed = self.prompt_logprobs.cost if self.prompt_logprobs is not None else []
        spent = math.fsum([*echoed, *(t.cost for t in self.tokens)])
        if self.finish_reason == "budget" and self.budget is not None:
            return max(spent, self.budget)
        return spent

    @property
    def completion_text(self) -> str:
        return "".join(t.text for t in self.tokens) + self.tail

    def apply(self, event: Any) -> None:
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event
        elif isinstance(event, TokenOutput):
            self.tokens.append(event)
        elif isinstance(event, Finished):
            self.tail += event.text
            self.finish_reason = event.finish_reason


@dataclass
class Run:
    """A generation request submitted to the engine: its event stream, its choices (filled in
    from the events), the id and creation time of its response, and what settles its charge
    once it is over (:meth:`settle`)."""

    stream: RequestStream
    choices: list[Choice]
    rid: str
    created: int
    on_settle: Any = None  # Callable[[float], None]: the client's charge, called once

    def settle(self) -> None:
        """Charge the caller what its choices were served (once; later calls do nothing)."""
        fn, self.on_settle = self.on_settle, None
        if fn is not None:
            fn(math.fsum(c.charged for c in self.choices))

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """The engine's ``(choice index, event)`` pairs (the caller applies each to its choice);
        a ``Failed`` event cancels the stream and raises its :class:`APIError`."""
        async for index, event in self.stream.events():
            if isinstance(event, Failed):
                self.stream.cancel()
                raise from_engine_error(event.error)
            yield index, event

    async def collect(self) -> None:
        """Apply every event to its choice, until each has finished."""
        try:
            async for index, event in self.events():
                self.choices[index].apply(event)
        finally:
            self.stream.cancel()

    def usage(self, n: int) -> Usage:
        """Token counts; each prompt counts once although its ``n`` choices each hold it."""
        prompt = sum(len(c.prompt_ids) for c in self.choices[::n])
        completion = sum(len(c.tokens) for c in self.choices)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


_DONE = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GenerationEndpoint(ABC):
    """One generation endpoint: subclasses say how a request becomes choices and engine
    sequences (:meth:`inputs`), its stream's events (:meth:`stream_body`) and its response
    (:meth:`build`); :meth:`respond` is the flow they share."""

    id_prefix: ClassVar[str]  # of the response id
    chunk_type: ClassVar[type[CompletionChunk] | type[ChatCompletionChunk]]  # of the usage event

    def __init__(self, state: ServingState) -> None:
        self.state = state

    @abstractmethod
    def inputs(self, req: Any) -> tuple[list[Choice], Sequences]:
        """Validated choices and their engine sequences (APIError: a 400 before the model)."""

    @abstractmethod
    def stream_body(self, req: Any, run: Run) -> AsyncIterator[str]:
        """The SSE events of the choices, as :meth:`Run.events` delivers them."""

    @abstractmethod
    def build(self, req: Any, run: Run) -> BaseModel:
        """The response, once every choice is collected."""

    def chunk(self, run: Run, choice: Any = None, *, usage: Usage | None = None) -> str:
        """One SSE event of the endpoint's chunk type: one choice, or none and the usage."""
        payload = self.chunk_type(
            id=run.rid,
            created=run.created,
            model=self.state.model_name,
            choices=[] if choice is None else [choice],
            usage=usage,
        )
        return sse(payload)

    def add_choices(
        self,
        choices: list[Choice],
        seqs: Sequences,
        req: GenerationRequest,
        text: str,
        ids: list[int],
        *,
        max_new_tokens: int,
    ) -> None:
        """Append the ``req.n`` choices of one prompt (``ids``, shown as ``text``) and their
        engine sequences; choice ``j`` samples with ``seed + j``."""
        for j in range(req.n):
            try:
                params = req.to_sampling_params(max_new_tokens=max_new_tokens, choice=j)
            except ValueError as exc:  # the schema admits it, the sampler does not: still a 400
                raise APIError(str(exc)) from exc
            choices.append(Choice(prompt_text=text, prompt_ids=ids))
            seqs.append((ids, params))

    async def respond(self, req: GenerationRequest, client: str | None = None) -> Response:
        """Validate, give each sequence its budget (``client``: the caller's key fingerprint;
        a 429 when its budget is spent), submit to the engine, then stream or collect the
        response; the caller is charged what it was served."""
        self.state.check_model(req.model)
        choices, seqs = self.inputs(req)
        accountant = self.state.accountant
        # BudgetExhaustedError: 429. Off the event loop: a ledger over the network may wait
        # for another replica's lock on the client.
        allotment = await run_in_threadpool(accountant.allot, client, len(seqs))
        seqs = _with_budgets(choices, seqs, allotment, self.state.config)

        def settle(nats: float, allotment: Allotment = allotment) -> None:
            accountant.settle(client, allotment, nats)

        try:
            stream = self.state.engine.submit(seqs)
        except (EngineOverloadedError, EngineStoppedError) as exc:
            settle(0.0)
            raise from_engine_error(exc) from exc
        rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        run = Run(stream, choices, rid, int(time.time()), on_settle=settle)
        if req.stream:
            events = self._sse(req, run)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            await run.collect()
        finally:
            run.settle()
        return json_response(self.build(req, run))

    async def _sse(self, req: GenerationRequest, run: Run) -> AsyncIterator[str]:
        """Frame a streamed response: the body's events, the usage event if the request asked for
        it, then ``[DONE]``. An engine failure, or any error once the stream has started, is sent
        as an SSE error event before ``[DONE]``; the engine stream is cancelled however it ends."""
        try:
            async for data in self.stream_body(req, run):
                yield data
            if req.include_usage_in_stream():
                yield self.chunk(run, usage=run.usage(req.n))
            yield _DONE
        except APIError as exc:  # raised by Run.events only: the bodies raise no APIError
            yield sse(exc.body())
            yield _DONE
        except Exception:  # an error after the stream started: SSE error event, then [DONE]
            logger.exception("streamed response %s failed", run.rid)
            yield sse(internal_error().body())
            yield _DONE
        finally:
            run.stream.cancel()
            run.settle()


def _with_budgets(
    choices: list[Choice], seqs: Sequences, allotment: Allotment, config: ServeConfig
) -> Sequences:
    """Each sequence's sampling parameters with its allotted budget (and its choice told) and
    the server's serving mode (``--on-budget``, ``--anchor``)."""
    out: Sequences = []
    for choice, (ids, params), budget in zip(choices, seqs, allotment.budgets, strict=True):
        choice.budget = budget
        mode = {"on_budget": config.on_budget, "anchor": config.anchor}
        out.append((ids, dataclasses.replace(params, budget=budget, **mode)))
    return out
