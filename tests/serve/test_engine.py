"""The batching scheduler on the real tiny ProtectedLM, without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from scpdr.runtime import PromptLogprobs, SamplingParams
from scpdr.serve.config import ServeConfig
from scpdr.serve.engine import (
    Engine,
    EngineOverloadedError,
    EngineStoppedError,
    Failed,
    Finished,
    TokenOutput,
)
from scpdr.serve.protocol import CompletionRequest

PROMPTS = ["The weather explains", "My friend asks about the meeting", "A small cat"]


def _ids(lm, text):
    return list(lm.tokenizer(text)["input_ids"])


async def _run(engine: Engine, seqs):
    stream = engine.submit(seqs)
    out: dict[int, list] = {i: [] for i in range(len(seqs))}
    async for i, ev in stream.events():
        out[i].append(ev)
    return out


def test_one_batch_honours_each_sequences_parameters(serve_lm):
    engine = Engine(serve_lm, max_batch=8, batch_wait_s=0.0).start()
    try:
        seqs = [
            (_ids(serve_lm, PROMPTS[0]), SamplingParams(max_new_tokens=5)),
            (
                _ids(serve_lm, PROMPTS[1]),
                SamplingParams(max_new_tokens=3, temperature=1.0, seed=11),
            ),
            (_ids(serve_lm, PROMPTS[2]), SamplingParams(max_new_tokens=4, logprobs=2)),
            (
                _ids(serve_lm, PROMPTS[0]),
                SamplingParams(max_new_tokens=0, logprobs=1, echo=True),
            ),
        ]
        out = asyncio.run(_run(engine, seqs))
        stats = engine.stats()
    finally:
        engine.stop()
    assert stats["batches_run"] == 1 and stats["largest_batch"] == 4  # one shared batch

    solo = [
        serve_lm.generate([PROMPTS[0]], max_new_tokens=5)[0],
        serve_lm.generate([PROMPTS[1]], max_new_tokens=3, temperature=1.0, seed=11)[0],
        serve_lm.generate([PROMPTS[2]], max_new_tokens=4, top_logprobs=2)[0],
    ]
    for i, ref in enumerate(solo):
        toks = [e for e in out[i] if isinstance(e, TokenOutput)]
        assert [t.token_id for t in toks] == ref.token_ids
        assert "".join(t.text for t in toks) == ref.text
        assert [t.k_x for t in toks] == pytest.approx(ref.k_x, abs=1e-5)  # padding: float noise
        assert isinstance(out[i][-1], Finished) and out[i][-1].finish_reason == ref.finish_reason
        assert all(len(t.top_logprobs) == (2 if i == 2 else 0) for t in toks)
    echo = out[3]
    assert [type(e) for e in echo] == [PromptLogprobs, Finished]
    n = len(_ids(serve_lm, PROMPTS[0])) - 1
    assert len(echo[0].token_logprobs) == len(echo[0].k_x) == len(echo[0].t_x) == n
    assert all(len(t) == 1 for t in echo[0].top_logprobs)


def test_queue_bound_and_lifecycle(serve_lm):
    engine = Engine(serve_lm, max_batch=1, max_queue=2)
    seq = (_ids(serve_lm, "Hello"), SamplingParams(max_new_tokens=1))

    async def submit(n):
        return engine.submit([seq] * n)

    with pytest.raises(EngineStoppedError):
        asyncio.run(submit(1))  # not started
    engine.start()
    try:
        with pytest.raises(EngineOverloadedError):
            asyncio.run(submit(3))  # more than the queue holds: all or none
        out = asyncio.run(_run(engine, [seq, seq]))
        assert all(isinstance(evs[-1], Finished) for evs in out.values())
    finally:
        engine.stop()
    assert not engine.alive
    with pytest.raises(EngineStoppedError):
        asyncio.run(submit(1))


def test_stop_finishes_the_running_batch_and_fails_waiting_sequences(serve_lm):
    engine = Engine(serve_lm, max_batch=1, max_queue=8, batch_wait_s=0.0).start()
    long = (_ids(serve_lm, "Hi"), SamplingParams(max_new_tokens=40))

    async def go():
        running = engine.submit([long]).events()
        waiting = engine.submit([long, long]).events()
        first = await anext(running)  # the worker holds the first request
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        rest = [ev async for _, ev in running]
        return [first[1], *rest], [ev async for _, ev in waiting]

    ran, waited = asyncio.run(go())
    assert isinstance(ran[-1], Finished)  # the running batch completed
    assert sum(isinstance(e, TokenOutput) for e in ran) == 40
    assert len(waited) == 2 and all(isinstance(e, Failed) for e in waited)
    assert all(isinstance(e.error, EngineStoppedError) for e in waited)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("x", "")}, "stop"),
        ({"stop": 3}, "stop"),
        ({"seed": True}, "seed"),
        ({"logprobs": -2}, "logprobs"),
    ],
)
def test_sampling_params_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_echo_without_logprobs_does_not_score_the_prompt(serve_lm):
    engine = Engine(serve_lm, batch_wait_s=0.0).start()
    try:
        request = CompletionRequest(prompt=PROMPTS[0], max_tokens=0, echo=True)  # the text alone
        params = request.to_sampling_params(max_new_tokens=0)
        out = asyncio.run(_run(engine, [(_ids(serve_lm, PROMPTS[0]), params)]))
    finally:
        engine.stop()
    assert [type(e) for e in out[0]] == [Finished]


def test_engine_from_config_takes_the_batching_settings(serve_lm):
    config = ServeConfig(max_batch=3, max_queue=5, batch_wait_s=0.25)
    engine = Engine.from_config(serve_lm, config)
    assert (engine.max_batch, engine.max_queue, engine.batch_wait_s) == (3, 5, 0.25)


def test_engine_arguments_are_validated(serve_lm):
    with pytest.raises(ValueError, match="max_batch"):
        Engine(serve_lm, max_batch=0)
    with pytest.raises(ValueError, match="max_queue"):
        Engine(serve_lm, max_queue=0)
