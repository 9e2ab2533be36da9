"""The serving engine: a dynamic-batching scheduler over one :class:`~scpdr.runtime.ProtectedLM`
(STYLE.md 10, the "engine" of vLLM's protocol/engine/router split).

One worker thread owns the model. HTTP handlers (on the asyncio event loop) submit *sequences*
(one per prompt and choice, each with the runtime's
:class:`~scpdr.runtime.sampling.SamplingParams`) into a bounded FIFO queue; a full queue is an
:class:`EngineOverloadedError` (HTTP 429). The worker drains up to ``max_batch`` sequences and
runs one batched ``ProtectedLM.generate_stream(prompts, sampling=[...])`` over them, pushing
every event back to the submitting request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. A sequence with ``echo`` first gets its prompt's log-probs from
the runtime (:class:`~scpdr.runtime.PromptLogprobs`, every prefix read as a fresh request).
Concurrent requests therefore share model steps; a request that arrives while a batch runs waits
for the next one (static batches, no preemption: simple and correct).

Only aggregate quantities leave the worker: the aggregate log-probs log r(y|x), its top-k
alternatives, the certificate values k_x (Definition 2.1 with Theorems 2.3/2.7) and t_x
(Theorem 4.4), and each token's charge (the accountant, ``docs/accountant.md``). Constituent
distributions are never requested from the model here. A sequence's ``SamplingParams.budget``
is enforced by the runtime (a withheld token ends it with finish reason "budget").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from scpdr.errors import ScpdrError
from scpdr.runtime.outputs import PromptLogprobs
from scpdr.runtime.sampling import SamplingParams
from scpdr.serve.config import ServeConfig

__all__ = [
    "Engine",
    "EngineError",
    "EngineOverloadedError",
    "EngineStoppedError",
    "Failed",
    "Finished",
    "PromptLogprobs",
    "RequestStream",
    "TokenOutput",
]

logger = logging.getLogger(__name__)


class EngineError(ScpdrError):
    """The engine could not run a request."""


class EngineOverloadedError(EngineError):
    """The request queue is full; retry later (HTTP 429)."""


class EngineStoppedError(EngineError):
    """The engine is not running (not started, or shutting down)."""


# ---- events pushed to a request's queue: (sequence index within the request, event) ----------


@dataclass(frozen=True)
class TokenOutput:
    """One generated token: its text delta, its log-prob under the aggregate, alternatives, the
    certificate of the distribution it was drawn from (k_x: Def. 2.1; t_x: Theorem 4.4), its
    charge (``cost``, :func:`scpdr.bounds.token_cost`), its charge against the base (``anchor``,
    None when the row does not measure it) and whether it was drawn from the base (``fallback``:
    docs/accountant.md, Propositions 3-4)."""

    token_id: int
    text: str
    logprob: float
    k_x: float
    t_x: float
    top_logprobs: list[tuple[int, float]]
    cost: float = 0.0
    anchor: float | None = None
    fallback: bool = False


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "budget"
    text: str = ""  # text released with the end (e.g. a held-back partial stop string)


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = PromptLogprobs | TokenOutput | Finished | Failed


class RequestStream:
    """The engine's answer channel for one HTTP request: ``(sequence index, event)`` pairs.

    Created on the event loop; the worker thread pushes with :meth:`push` (thread-safe).
    """

    def __init__(self, n_sequences: int, loop: asyncio.AbstractEventLoop) -> None:
        self.n_sequences = n_sequences
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.cancelled = False
        self._open = n_sequences

    def push(self, index: int, event: Event) -> None:
        """Thread-safe: deliver an event to the request's event loop (dropped once cancelled)."""
        if self.cancelled:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
        except RuntimeError:  # the loop is closed: the client is gone
            self.cancelled = True

    def cancel(self) -> None:
        """Stop caring about this request; the worker skips or abandons its sequences."""
        self.cancelled = True

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """Yield events until every sequence has finished or failed."""
        try:
            while self._open > 0:
                index, event = await self._queue.get()
                if isinstance(event, (Finished, Failed)):
                    self._open -= 1
                yield index, event
        finally:
            if self._open > 0:
                self.cancel()


@dataclass
class _Sequence:
    stream: RequestStream
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    def push(self, event: Event) -> None:
        self.stream.push(self.index, event)


class Engine:
    """Dynamic batching over one protected model, run by a single worker thread.

    Args:
        lm: a :class:`~scpdr.runtime.ProtectedLM` (anything with its ``generate_stream``).
        max_batch: most sequences decoded together in one batched call.
        max_queue: most sequences waiting; beyond it :meth:`submit` raises
            :class:`EngineOverloadedError` (HTTP 429).
        batch_wait_s: after the first sequence arrives, wait this long for more before starting
            a batch (only when the worker was idle).
    """

    def __init__(
        self,
        lm: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 256,
        batch_wait_s: float = 0.005,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.lm = lm
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.batch_wait_s = float(batch_wait_s)
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running = 0
        self.batches_run = 0
        self.sequences_run = 0
        self.largest_batch = 0

    @classmethod
    def from_config(cls, lm: Any, config: ServeConfig) -> Engine:
        """The engine of ``lm`` with the batching settings of ``config``."""
        return cls(
            lm,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            batch_wait_s=config.batch_wait_s,
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Engine:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._worker, name="scpdr-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop after the running batch; waiting sequences fail with :class:`EngineStoppedError`."""
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for seq in pending:
            seq.push(Failed(EngineStoppedError("the server is shutting down")))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "queued": len(self._queue),
                "running": self._running,
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "batches_run": self.batches_run,
                "sequences_run": self.sequences_run,
                "largest_batch": self.largest_batch,
            }

    # ---- submission (event loop side) ------------------------------------------------------

    def submit(
        self,
        sequences: Sequence[tuple[list[int], SamplingParams]],
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Queue one request's sequences (all or none) and return the stream of their events.

        Raises:
            EngineOverloadedError: the queue cannot take them now (HTTP 429).
            EngineStoppedError: the engine is not running.
        """
        if not sequences:
            raise ValueError("a request needs at least one sequence")
        loop = loop or asyncio.get_running_loop()
        stream = RequestStream(len(sequences), loop)
        seqs = [
            _Sequence(stream, i, list(ids), params) for i, (ids, params) in enumerate(sequences)
        ]
        with self._cond:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            if len(self._queue) + len(seqs) > self.max_queue:
                raise EngineOverloadedError(
                    f"the server is busy ({len(self._queue)} sequences queued, at most "
                    f"{self.max_queue}); retry shortly"
                )
            self._queue.extend(seqs)
            self._cond.notify()
        return stream

    # ---- the worker ------------------------------------------------------------------------

    def _next_batch(self) -> list[_Sequence] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            partial = len(self._queue) < self.max_batch
        if partial and self.batch_wait_s > 0:
            time.sleep(self.batch_wait_s)  # let concurrent requests join this batch
        with self._cond:
            batch: list[_Sequence] = []
            while self._queue and len(batch) < self.max_batch:
                seq = self._queue.popleft()
                if not seq.cancelled:
                    batch.append(seq)
            self._running = len(batch)
            if batch:
                self.batches_run += 1
                self.sequences_run += len(batch)
                self.largest_batch = max(self.largest_batch, len(batch))
            return batch

    def _worker(self) -> None:
        import torch

        logger.info("engine worker started (max_batch=%d)", self.max_batch)
        while True:
            batch = self._next_batch()
            if batch is None:
                break
            if not batch:
                continue
            try:
                with torch.no_grad():
                    self._execute(batch)
            except Exception as exc:
                logger.exception("batch of %d sequences failed", len(batch))
                for seq in batch:
                    seq.push(Failed(exc))
            finally:
                with self._cond:
                    self._running = 0
        logger.info("engine worker stopped")

    def _execute(self, seqs: list[_Sequence]) -> None:
        """One batched ``generate_stream`` over ``seqs``, each with its own sampling parameters
        (the runtime scores the prompts of those with ``echo`` first)."""
        it = self.lm.generate_stream(
            [s.prompt_ids for s in seqs], sampling=[s.params for s in seqs]
        )
        finished: set[int] = set()
        try:
            for ev in it:
                seq = seqs[ev.index]
                if ev.prompt is not None:
                    seq.push(ev.prompt)
                if ev.token_id is not None:
                    seq.push(
                        TokenOutput(
                            token_id=int(ev.token_id),
                            text=ev.text_delta or "",
                            logprob=float(ev.logprob),
                            k_x=float(ev.k_x),
                            t_x=float(ev.t_x),
                            top_logprobs=[(int(t), float(v)) for t, v in ev.top_logprobs or []],
                            cost=float(ev.cost),
                            anchor=None if ev.anchor is None else float(ev.anchor),
                            fallback=bool(ev.fallback),
                        )
                    )
                if ev.finish_reason is not None:
                    tail = (ev.text_delta or "") if ev.token_id is None else ""
                    seq.push(Finished(str(ev.finish_reason), text=tail))
                    finished.add(ev.index)
                if all(s.cancelled for s in seqs):
                    logger.debug("every client of the batch is gone; abandoning it")
                    break
        finally:
            _suppress_close(it)
        for i, seq in enumerate(seqs):  # never leave a client waiting
            if i not in finished and not seq.cancelled:
                seq.push(Failed(EngineError("generation ended before this sequence finished")))


def _suppress_close(gen: Any) -> None:
    with contextlib.suppress(Exception):
        gen.close()
