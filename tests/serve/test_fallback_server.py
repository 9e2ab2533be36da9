"""The fallback to the base and base-anchored serving in the server, through the official
``openai`` client (``docs/accountant.md``, Propositions 3 and 4): ``--on-budget base`` answers
past the budget, the client budget is charged what the fallback costs (its ``sum_cost``) and a
restart keeps it; the modes are refused where there is no base model."""

from __future__ import annotations

import pytest
from openai_helpers import balance as _balance
from openai_helpers import client as _client
from openai_helpers import naf as _naf

from scpdr.errors import ConfigError

PROMPT = "The weather explains the results"
KEY = "key-one"
BUDGET = 8.0  # nats: a few tokens of this bundle (its constituent 0 memorized a secret)


def test_on_budget_base_answers_past_the_budget_and_is_charged_its_cost(
    start_server, model_id, serve_lm, tmp_path
):
    stop = serve_lm.generate([PROMPT], max_new_tokens=16, temperature=0.0, budget=BUDGET)[0]
    (ref,) = serve_lm.generate(
        [PROMPT],
        max_new_tokens=16,
        temperature=0.0,
        top_logprobs=1,
        budget=BUDGET,
        on_budget="base",
    )
    assert stop.finish_reason == "budget" and len(stop.token_ids) < 16  # the stop rule cuts
    assert ref.finish_reason == "length" and ref.fallback_at is not None  # the fallback answers
    settings = dict(
        budget=BUDGET,
        on_budget="base",
        api_key=KEY,
        client_budget=100.0,
        budget_db=str(tmp_path / "usage.sqlite"),
    )
    with start_server(**settings) as url:
        out = _client(url, KEY).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1
        )
        (choice,) = out.choices
        naf = _naf(choice)
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 16
        assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert naf["cost"] == pytest.approx(ref.cost, abs=1e-4)
        assert naf["sum_cost"] == pytest.approx(ref.sum_cost, abs=1e-4)
        assert naf["sum_cost"] <= BUDGET and naf["budget_left"] >= 0
        assert all(v == 0 for v in naf["cost"][ref.fallback_at :])  # base tokens cost 0
        # the client is charged what the response cost (not the whole budget, as after a stop)
        first = _balance(url, KEY)["spent"]
        assert first == pytest.approx(naf["sum_cost"], abs=1e-6)
    with start_server(**settings) as url:  # a restart: the ledger remembers
        assert _balance(url, KEY)["spent"] == pytest.approx(first, abs=1e-6)
        again = _client(url, KEY).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=16, temperature=0
        )
        assert again.choices[0].finish_reason == "length"
        total = first + _naf(again.choices[0])["sum_cost"]
        assert _balance(url, KEY)["spent"] == pytest.approx(total, abs=1e-6)


def test_anchored_server_serves_the_anchored_distribution(start_server, model_id, serve_lm):
    (ref,) = serve_lm.generate(
        [PROMPT], max_new_tokens=8, temperature=0.0, top_logprobs=1, anchor=0.5
    )
    with start_server(anchor=0.5) as url:
        out = _client(url).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1
        )
    (choice,) = out.choices
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert _naf(choice)["cost"] == pytest.approx(ref.cost, abs=1e-4)


def test_naf_reports_the_fallback_and_the_charges_against_the_base(
    start_server, model_id, serve_lm
):
    (ref,) = serve_lm.generate(
        [PROMPT],
        max_new_tokens=16,
        temperature=0.0,
        budget=BUDGET,
        on_budget="base",
        anchor=0.5,
    )
    with start_server(budget=BUDGET, on_budget="base", anchor=0.5) as url:
        out = _client(url).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=16, temperature=0
        )
    naf = _naf(out.choices[0])
    assert naf["fallback_at"] == ref.fallback_at and naf["private_tokens"] == ref.private_tokens
    assert naf["anchor"] == pytest.approx(ref.anchor, abs=1e-4)
    assert naf["sum_anchor"] == pytest.approx(ref.sum_anchor, abs=1e-4)


def test_modes_need_a_base_model(serve_bundle):
    from scpdr.runtime import ProtectedLM
    from scpdr.serve import Engine, ServeConfig, create_app

    with pytest.raises(ConfigError, match="--on-budget must be 'stop' or 'base'"):
        ServeConfig(on_budget="later")
    with pytest.raises(ConfigError, match="must be 'model' with --anchor"):
        ServeConfig(anchor=1.0, base="constant")
    with pytest.raises(ConfigError, match="--anchor must be >= 0"):
        ServeConfig(anchor=-1.0)
    cp = ProtectedLM.from_bundle(serve_bundle, method="cp-delta-r")
    settings = ServeConfig(on_budget="base", budget=1.0)
    with pytest.raises(ConfigError, match="runs no base model"):
        create_app(Engine.from_config(cp, settings), settings)
