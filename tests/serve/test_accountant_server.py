"""The accountant in the server, through the official ``openai`` client: per-response budgets,
per-key budgets summed over responses (n > 1, echo, streaming), 429 past the budget with its
refill time, ``GET /v1/budget``, and usage kept across a restart (the SQLite ledger)."""

from __future__ import annotations

import math

import httpx
import pytest
from openai_helpers import balance as _balance
from openai_helpers import client as _client
from openai_helpers import naf as _naf

PROMPT = "The weather explains the results"
K1, K2 = "key-one", "key-two"


def _charged(choices) -> float:
    """What the server charges for these choices: sum_cost, or the whole budget after a stop."""
    total = 0.0
    for c in choices:
        naf = _naf(c)
        if c.finish_reason == "budget":
            total += naf["sum_cost"] + naf["budget_left"]
        else:
            total += naf["sum_cost"]
    return total


def test_per_response_budget_matches_the_runtime(start_server, model_id, serve_lm):
    budget = 8.0  # nats: a few tokens of this bundle (its constituent 0 memorized a secret)
    with start_server(budget=budget) as url:
        out = _client(url).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2, n=2
        )
    (ref,) = serve_lm.generate(
        [PROMPT], max_new_tokens=16, temperature=0.0, top_logprobs=2, budget=budget
    )
    assert ref.finish_reason == "budget" and 0 < len(ref.token_ids) < 16  # a real cut
    for choice in out.choices:
        naf = _naf(choice)
        assert choice.finish_reason == "budget"
        assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert naf["cost"] == pytest.approx(ref.cost, abs=1e-4)  # batch of 2 vs 1: rounding
        assert naf["t_x"] == pytest.approx(ref.t_x, abs=1e-4)
        assert (
            naf["sum_cost"] == pytest.approx(ref.sum_cost, abs=1e-4) and naf["sum_cost"] <= budget
        )
        assert naf["sum_t_x"] == pytest.approx(sum(ref.t_x), abs=1e-4)
        assert naf["budget_left"] == pytest.approx(budget - naf["sum_cost"], abs=1e-9)
    # no budget: the same fields, budget_left null, the response certificate still summed
    with start_server() as url:
        out = _client(url).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
        )
    naf = _naf(out.choices[0])
    assert naf["budget_left"] is None and out.choices[0].finish_reason == "length"
    assert len(naf["prompt_cost"]) == len(naf["prompt_t_x"]) and naf["prompt_cost"][0] is None
    served = [*naf["cost"], *naf["prompt_cost"][1:]]
    assert naf["sum_cost"] == pytest.approx(math.fsum(served), abs=1e-9)


def test_client_budget_is_per_key_kept_across_a_restart_and_429_when_spent(
    start_server, model_id, tmp_path
):
    import openai

    settings = dict(api_key=f"{K1},{K2}", client_budget=60.0, budget_db=str(tmp_path / "u.db"))
    with start_server(**settings) as url:
        c1 = _client(url, K1)
        assert _balance(url, K1)["remaining"] == 60.0 and _balance(url, K1)["spent"] == 0.0
        # n = 2 with echo: both choices and the echoed prompt positions are charged
        out = c1.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=2, temperature=0, n=2, echo=True, logprobs=1
        )
        first = _charged(out.choices)
        for c in out.choices:  # every prompt position served (entry 0: no context) and charged
            assert len(_naf(c)["prompt_cost"]) == len(c.logprobs.tokens) - 2
            assert all(v > 0 for v in _naf(c)["prompt_cost"][1:])
            assert first > 2 * math.fsum(_naf(c)["prompt_cost"][1:])
        bal = _balance(url, K1)
        assert bal["spent"] == pytest.approx(first, abs=1e-6)
        assert bal["remaining"] == pytest.approx(60.0 - first, abs=1e-6)
        assert bal["budget"] == 60.0 and bal["window_s"] is None and bal["refills_at"] is None
        assert bal["client"] != K1 and K1 not in str(bal)  # a fingerprint, never the key
    with start_server(**settings) as url:  # a restart: the usage file remembers
        assert _balance(url, K1)["spent"] == pytest.approx(first, abs=1e-6)
        c1 = _client(url, K1)
        out = c1.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=200, temperature=0, n=2
        )
        assert [c.finish_reason for c in out.choices] == ["budget", "budget"]
        shares = [_naf(c)["sum_cost"] + _naf(c)["budget_left"] for c in out.choices]
        assert shares == pytest.approx([(60.0 - first) / 2] * 2, abs=1e-6)  # equal shares
        assert _balance(url, K1)["remaining"] == pytest.approx(0.0, abs=1e-6)
        with pytest.raises(openai.RateLimitError) as info:
            c1.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
        err = info.value
        assert err.status_code == 429 and err.body["code"] == "budget_exceeded"
        assert "60 nats" in err.body["message"] and "does not refill" in err.body["message"]
        with pytest.raises(openai.RateLimitError):  # chat is charged to the same key
            c1.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        # the other key has its own budget
        other = _client(url, K2).completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
        assert other.choices[0].finish_reason == "length"
        assert _balance(url, K2)["spent"] == pytest.approx(_charged(other.choices), abs=1e-6)


def test_streaming_is_charged_and_the_window_names_the_refill(start_server, model_id, tmp_path):
    import openai

    settings = dict(
        api_key=K1, client_budget=10.0, budget_window=3600.0, budget_db=str(tmp_path / "w.db")
    )
    with start_server(**settings) as url:
        c1 = _client(url, K1)
        chunks = list(
            c1.completions.create(
                model=model_id, prompt=PROMPT, max_tokens=100, temperature=0, stream=True
            )
        )
        token_chunks = [c for c in chunks if c.choices and c.choices[0].text]
        last = chunks[-1].choices[0]
        assert last.finish_reason == "budget"
        streamed = [v for c in token_chunks for v in _naf(c.choices[0])["cost"]]
        assert _naf(last)["sum_cost"] == pytest.approx(math.fsum(streamed), abs=1e-9)
        assert _naf(last)["sum_cost"] + _naf(last)["budget_left"] == pytest.approx(10.0)
        assert 0 < len(token_chunks) < 100
        bal = _balance(url, K1)
        assert bal["remaining"] == pytest.approx(0.0, abs=1e-9)
        assert bal["window_s"] == 3600.0 and bal["refills_at"] is not None
        with pytest.raises(openai.RateLimitError) as info:
            c1.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, stream=True)
        err = info.value
        assert "refills at" in err.body["message"] and "per 3600 s" in err.body["message"]
        wait = float(err.response.headers["retry-after"])
        assert 3500 < wait <= 3600


def test_budget_endpoint_needs_the_key_and_reports_nulls_without_a_client_budget(
    start_server,
):
    with start_server(api_key=K1, budget=2.0) as url:
        assert httpx.get(url + "/v1/budget", timeout=30).status_code == 401
        bal = _balance(url, K1)
        assert bal["response_budget"] == 2.0 and bal["budget"] is None and bal["spent"] is None
