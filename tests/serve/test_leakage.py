"""Only the aggregate distribution is served: the log-probs a client sees equal ProtectedLM's
aggregate r(·|x) and differ from every constituent's (and the base's), including the constituent
that memorized a secret (the black-box threat model of the paper, Definition 4.1)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch


@pytest.fixture(scope="module")
def base_url(start_server):
    with start_server() as url:
        yield url


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    return [x for v in obj for x in _numbers(v)]


def test_echo_logprobs_are_the_aggregate_and_no_constituents(base_url, serve_lm, secret, model_id):
    ids = serve_lm.tokenizer(secret)["input_ids"]
    body = {"model": model_id, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 5}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200
    lp = resp.json()["choices"][0]["logprobs"]
    served = torch.tensor(lp["token_logprobs"][1:])  # (T-1,)

    x = torch.tensor([ids])
    ref = serve_lm.score(x, full=True, components=True)
    target = x[0, 1:, None]  # (T-1, 1)
    assert torch.allclose(served, ref.token_logprobs[0], atol=1e-5)

    logps = ref.components.logps[:, 0]  # (K, T-1, V) constituents' log-softmax
    dists = {f"constituent {i}": logps[i] for i in range(logps.shape[0])}
    dists["base"] = ref.components.base[0]  # 'b' variant: (T-1, V)
    assert len(dists) == serve_lm.num_constituents + 1 == 3
    for name, dist in dists.items():
        theirs = dist.gather(-1, target)[:, 0]
        assert (served - theirs).abs().max() > 1e-3, f"served log-probs equal {name}'s"
        if name == "base":
            # the base is the public pre-fine-tuning model: SCP-Δr smooths towards it, so off
            # the kept tokens r ≈ b (Alg. 1) and the best alternatives may coincide; not a leak
            continue
        top = dist.topk(5, dim=-1).values  # their alternatives are not served either
        served_tops = torch.tensor([sorted(d.values())[-1] for d in lp["top_logprobs"][1:]])
        assert not torch.allclose(served_tops, top[:, 0], atol=1e-4), name
    # constituent 0 memorized the secret; the served model does not reproduce its confidence
    mem = dists["constituent 0"].gather(-1, target)[:, 0].sum()
    other = dists["constituent 1"].gather(-1, target)[:, 0].sum()
    assert mem > other + 20  # the secret really is memorized by constituent 0 ...
    assert served.sum() < mem - 20  # ... and is not what the API serves

    # no number anywhere in the response is a constituent's log-prob of a served token
    numbers = torch.tensor(_numbers(resp.json()))
    for name, dist in dists.items():
        if name == "base":
            continue
        theirs = dist.gather(-1, target)[:, 0]
        close = (numbers[:, None] - theirs[None, :]).abs() < 1e-6
        assert not close.any(), f"a served number equals {name}'s log-prob"


def test_generated_alternatives_are_the_aggregate(base_url, serve_lm, secret, model_id):
    prefix = secret[: secret.index("is") + 2]
    body = {"model": model_id, "prompt": prefix, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    choice = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = torch.tensor([serve_lm.tokenizer(prefix)["input_ids"]])
    agg = serve_lm.next_token_logprobs(ids)[0]  # (V,)
    top = agg.topk(5)
    served = choice["logprobs"]["top_logprobs"][0]
    assert sorted(served.values(), reverse=True)[:5] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert json.dumps(choice).count("components") == 0
