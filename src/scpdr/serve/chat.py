"""``POST /v1/chat/completions`` (after vLLM's ``serving_chat.py``): the prompt is the tokenizer's
chat template of ``messages`` with the generation prompt; log-probs in the chat list shape;
streaming sends the role in the first delta of each choice.

The flow (validation, engine, streaming frame, usage) is :class:`~scpdr.serve.serving.
GenerationEndpoint`'s; this module says only what differs for chat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from scpdr.serve.engine import Finished, TokenOutput
from scpdr.serve.errors import APIError
from scpdr.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
)
from scpdr.serve.serving import Choice, GenerationEndpoint, Run, Sequences, ServingState
from scpdr.serve.tokens import chat_logprobs

__all__ = ["ChatEndpoint", "chat_prompt"]


def chat_prompt(state: ServingState, messages: Sequence[ChatMessage], *, gen: bool) -> str:
    """The tokenizer's chat template of ``messages`` (``gen``: with the generation prompt);
    "developer" is sent as "system". What is served matches what was learned only when the
    constituents were trained on chat records with this same template."""
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


class ChatEndpoint(GenerationEndpoint):
    id_prefix = "chatcmpl"
    chunk_type = ChatCompletionChunk

    def inputs(self, req: ChatCompletionRequest) -> tuple[list[Choice], Sequences]:
        state = self.state
        state.check_sequences(req.n)
        text = chat_prompt(state, req.messages, gen=True)
        ids = state.encode(text, add_special_tokens=False)
        state.check_ids(ids, param="messages")
        max_new = state.max_new_tokens(
            len(ids), req.max_new_tokens(), param="max_completion_tokens"
        )
        choices: list[Choice] = []
        seqs: Sequences = []
        self.add_choices(choices, seqs, req, text, ids, max_new_tokens=max_new)
        return choices, seqs

    def build(self, req: ChatCompletionRequest, run: Run) -> ChatCompletionResponse:
        k = req.top_logprobs or 0
        text = self.state.text
        return ChatCompletionResponse(
            id=run.rid,
            created=run.created,
            model=self.state.model_name,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=c.completion_text),
                    logprobs=chat_logprobs(text, c.tokens, k) if req.logprobs else None,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                    naf=self.state.certificate(c.tokens, budget=c.budget),
                )
                for i, c in enumerate(run.choices)
            ],
            usage=run.usage(req.n),
        )

    def _chunk(self, run: Run, i: int, delta: DeltaMessage, **kw: Any) -> str:
        return self.chunk(run, ChatChunkChoice(index=i, delta=delta, **kw))

    async def stream_body(self, req: ChatCompletionRequest, run: Run) -> AsyncIterator[str]:
        """The role of every choice first, in its own delta; then one chunk per token and one
        with the finish reason (and any held-back text)."""
        k = req.top_logprobs or 0
        for i in range(len(run.choices)):
            yield self._chunk(run, i, DeltaMessage(role="assistant", content=""))
        async for i, event in run.events():
            c = run.choices[i]
            c.apply(event)
            n = len(c.tokens)
            if isinstance(event, TokenOutput):
                yield self._chunk(
                    run,
                    i,
                    DeltaMessage(content=event.text),
                    logprobs=chat_logprobs(self.state.text, [event], k) if req.logprobs else None,
                    naf=self.state.certificate(c.tokens, budget=c.budget, listed=slice(n - 1, n)),
                )
            elif isinstance(event, Finished):
                yield self._chunk(
                    run,
                    i,
                    DeltaMessage(content=event.text or None),
                    finish_reason=event.finish_reason,
                    naf=self.state.certificate(c.tokens, budget=c.budget, listed=slice(n, n)),
                )
