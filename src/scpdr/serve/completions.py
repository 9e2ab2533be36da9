"""``POST /v1/completions`` (after vLLM's ``serving_completion.py``): prompts as text or token ids,
``n`` choices each, ``echo`` (with the prompt's log-probs), the legacy log-prob shape, streaming.

The flow (validation, engine, streaming frame, usage) is :class:`~scpdr.serve.serving.
GenerationEndpoint`'s; this module says only what differs for completions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from scpdr.serve.engine import Finished, PromptLogprobs, TokenOutput
from scpdr.serve.errors import APIError
from scpdr.serve.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from scpdr.serve.serving import Choice, GenerationEndpoint, Run, Sequences
from scpdr.serve.tokens import completion_logprobs

__all__ = ["CompletionEndpoint"]

_NONE = slice(0, 0)


class CompletionEndpoint(GenerationEndpoint):
    id_prefix = "cmpl"
    chunk_type = CompletionChunk

    def inputs(self, req: CompletionRequest) -> tuple[list[Choice], Sequences]:
        state = self.state
        try:
            prompts = req.prompts()
        except ValueError as exc:
            raise APIError(str(exc), param="prompt") from exc
        state.check_sequences(len(prompts) * req.n)
        choices: list[Choice] = []
        seqs: Sequences = []
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
            self.add_choices(choices, seqs, req, text, ids, max_new_tokens=max_new)
        return choices, seqs

    def _logprobs(
        self, choice: Choice, tokens: list[TokenOutput], k: int, *, echo: bool, start: int = 0
    ) -> CompletionLogprobs:
        return completion_logprobs(
            self.state.text,
            tokens,
            k=k,
            prompt_ids=choice.prompt_ids if echo else (),
            prompt_logprobs=choice.prompt_logprobs,
            start=start,
        )

    def _choice(self, req: CompletionRequest, index: int, choice: Choice) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._logprobs(choice, choice.tokens, req.logprobs, echo=req.echo)
        return CompletionChoice(
            index=index,
            text=(choice.prompt_text if req.echo else "") + choice.completion_text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
            naf=self.state.certificate(choice.tokens, choice.prompt_logprobs, budget=choice.budget),
        )

    def build(self, req: CompletionRequest, run: Run) -> CompletionResponse:
        return CompletionResponse(
            id=run.rid,
            created=run.created,
            model=self.state.model_name,
            choices=[self._choice(req, i, c) for i, c in enumerate(run.choices)],
            usage=run.usage(req.n),
        )

    def _chunk(
        self,
        run: Run,
        i: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        finish: str | None,
        listed: slice,
        list_prompt: bool = False,
    ) -> str:
        c = run.choices[i]
        naf = self.state.certificate(
            c.tokens, c.prompt_logprobs, budget=c.budget, listed=listed, list_prompt=list_prompt
        )
        choice = CompletionChoice(
            index=i,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            naf=naf,
        )
        return self.chunk(run, choice)

    async def stream_body(self, req: CompletionRequest, run: Run) -> AsyncIterator[str]:
        """Per choice: the echoed prompt first (with its log-probs and certificate lists), then
        one chunk per token, then one with the finish reason (and any held-back text)."""
        started = [False] * len(run.choices)
        offsets = [0] * len(run.choices)
        k = req.logprobs
        async for i, event in run.events():
            c = run.choices[i]
            if isinstance(event, PromptLogprobs):  # sent with the echo chunk
                c.apply(event)
                continue
            if not started[i] and req.echo:  # the echoed prompt comes first
                started[i] = True
                lp = None if k is None else self._logprobs(c, [], k, echo=True)
                offsets[i] = len(c.prompt_text)
                yield self._chunk(run, i, c.prompt_text, lp, None, _NONE, list_prompt=True)
            c.apply(event)
            if isinstance(event, TokenOutput):
                lp = None
                if k is not None:
                    lp = self._logprobs(c, [event], k, echo=False, start=offsets[i])
                offsets[i] += len(event.text)
                n = len(c.tokens)
                yield self._chunk(run, i, event.text, lp, None, slice(n - 1, n))
            elif isinstance(event, Finished):
                yield self._chunk(run, i, event.text, None, event.finish_reason, _NONE)
