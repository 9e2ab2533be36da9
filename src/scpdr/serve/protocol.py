"""The OpenAI wire format: pydantic request and response models (STYLE.md 10, after vLLM
``entrypoints/openai/protocol.py``).

Requests are validated here, before anything reaches the model: a malformed request becomes a
400 with the OpenAI error shape (:mod:`scpdr.serve.errors`), never a 500. A request's
``to_sampling_params`` builds the runtime's :class:`~scpdr.runtime.sampling.SamplingParams` of
each of its sequences. Everything a response can carry is the *aggregate* distribution r(·|x) of the protected
model (the paper's black-box TDE game, Definition 4.2 of the paper); no field
exists for a constituent's distribution.

Each response choice carries the extension object ``naf`` (:class:`NafCertificate`): the NAF bound
``k_x`` of every served token (Definition 2.1; Theorems 2.3/2.7, SCP-Δr via Algorithm 1) and the
per-token LiRA bound ``t_x`` (Theorem 4.4), with their maxima over the choice, and the
accountant's charge ``cost`` of each token: ``sum_cost`` certifies the whole response (its
log-likelihood ratio against every constituent is at most ``sum_cost`` <= ``sum_t_x``;
``docs/accountant.md``). The maxima bound each token on its own, not the response.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from scpdr.runtime.sampling import SamplingParams
from scpdr.serve.certificate import NafCertificate

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "ErrorBody",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "NafCertificate",
    "TokenizeRequest",
    "Usage",
    "seed_for",
]

#: Most alternatives per position (OpenAI's limit for ``logprobs`` / ``top_logprobs``).
MAX_LOGPROBS = 20
#: Most choices per prompt.
MAX_N = 16
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def seed_for(seed: int | None, choice: int) -> int | None:
    """Choice ``j`` of a prompt samples with ``seed + j`` (wrapped into int64)."""
    if seed is None:
        return None
    return (seed + choice - _INT64_MIN) % 2**64 + _INT64_MIN


class _Request(BaseModel):
    """Unknown fields are ignored (clients send vendor extensions); known ones are checked."""

    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: StrictBool = Field(
        False, description="Send a last chunk with the request's usage and no choices."
    )


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = Field(None, description="The served model's id (GET /v1/models).")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="0 is greedy decoding; default 1."
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling; default 1.")
    top_k: StrictInt | None = Field(
        None, ge=-1, description="Extension (as in vLLM): keep the k most likely; 0 or -1 = off."
    )
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="Choices per prompt.")
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description="Stop strings (any number); the stop string is not returned."
    )
    seed: StrictInt | None = Field(
        None,
        ge=_INT64_MIN,
        le=_INT64_MAX,
        description="Sampling seed; choice j of a prompt uses seed + j.",
    )
    stream: StrictBool = Field(False, description="Server-sent events, ending with [DONE].")
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None

    @model_validator(mode="after")
    def _check_sampling(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(
                    f"{name} is not supported by the protected model; omit it or send 0"
                )
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by the protected model; omit it")
        return self

    def stop_list(self) -> list[str]:
        """The stop strings as a list, empty strings dropped (they would stop at once)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def _sampling_params(
        self, *, max_new_tokens: int, choice: int, logprobs: int | None, echo: bool
    ) -> SamplingParams:
        """Choice ``choice``'s sampling parameters, with OpenAI's defaults filled in
        (temperature 1, top_p 1, top_k off) and its seed ``seed + choice``. ``echo`` is the
        runtime's: score the prompt (only asked for when its log-probs are served; the echoed
        text itself is the endpoint's)."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None or self.top_k < 0 else int(self.top_k),
            stop=tuple(self.stop_list()),
            seed=seed_for(self.seed, choice),
            logprobs=logprobs,
            echo=echo,
        )

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


#: "budget": the next token's charge would have taken the response past its budget (withheld).
FinishReason = Literal["stop", "length", "budget"]


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# --------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------

PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` token ids are used exactly as given (no BOS added)."""

    prompt: PromptType = Field(
        description="A string, a list of strings, a list of token ids or a list of such lists."
    )
    max_tokens: StrictInt | None = Field(
        16, ge=0, description="Tokens to generate (0 allowed with echo); null = up to the context."
    )
    logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return log-probs with this many alternatives."
    )
    echo: StrictBool = Field(False, description="Prepend the prompt (and its log-probs).")
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported; omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n); omit it")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 unless echo is true")
        return self

    def to_sampling_params(self, *, max_new_tokens: int, choice: int = 0) -> SamplingParams:
        """Sequence ``choice`` of a prompt (``max_new_tokens``: ``max_tokens`` checked against
        the context, or the room left in it when ``max_tokens`` is null)."""
        return self._sampling_params(
            max_new_tokens=max_new_tokens,
            choice=choice,
            logprobs=self.logprobs,
            echo=self.echo and self.logprobs is not None,
        )

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list of strings or a list of token-id lists (at least one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[return-value]


class CompletionLogprobs(_Response):
    """The legacy completions log-prob shape (one entry per token of ``text``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    naf: NafCertificate


class _Envelope(_Response):
    """The fields every generation response and stream chunk opens with, in OpenAI's order;
    each subclass narrows ``object`` to its literal (the field keeps its place)."""

    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChunk(_Envelope):
    """One SSE event of a streamed completion; the usage event has no choices."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Request):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template of ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, description="Deprecated alias.")
    max_completion_tokens: StrictInt | None = Field(
        None, ge=1, description="Tokens to generate; null = up to the context."
    )
    logprobs: StrictBool = Field(False, description="Return the chosen tokens' log-probs.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools or self.functions:
            raise ValueError("tools/function calling is not supported; omit tools")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported; omit it")
        return self

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, else the deprecated ``max_tokens`` (null: up to the context)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, *, max_new_tokens: int, choice: int = 0) -> SamplingParams:
        """Choice ``choice`` (``max_new_tokens``: :meth:`max_new_tokens` checked against the
        context, or the room left in it)."""
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            max_new_tokens=max_new_tokens, choice=choice, logprobs=top, echo=False
        )


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    naf: NafCertificate


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    naf: NafCertificate | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------------------------
# Models, tokenizer endpoints (the ones lm-eval's RemoteTokenizer calls), errors
# --------------------------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "scpdr"
    max_model_len: int
    naf: dict[str, Any] = Field(description="method, m, name, constituents of the served model")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's shape): a ``prompt`` or chat ``messages``."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorBody
