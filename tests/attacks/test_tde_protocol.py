"""The TDE game's protocol (Def. 4.2) on a real stateful method: every attack reads what a fresh
request of each prefix returns; canary exposure scores the secret as the continuation of its
prefix. CP-Fuse is the method where the two differ (its fused path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scpdr.attacks.evaluation import load_scorers
from scpdr.attacks.exposure import Canary, CanarySpace, canary_exposure
from scpdr.attacks.lira import lira
from scpdr.attacks.mia import membership_inference
from scpdr.attacks.scorer import (
    batched_position_stats,
    batched_token_logprobs,
    encode,
    score_requests,
)
from scpdr.attacks.tte import token_by_token_extraction
from scpdr.methods import SPECS

FUSE = next(n for n, s in SPECS.items() if s.rule == "cp-fuse")
TEXTS = ["Name: Ada Lovelace, ID: 0123456789", "The secret words are: alpha beta gamma"]


class WholePrefixPath:
    """The protocol the attacks used to follow, as an input to the attacks under test: the
    scorer's ``score`` without ``prompt_lengths`` (CP-Fuse's path = the whole row)."""

    def __init__(self, lm):
        self.lm, self.tokenizer, self.name = lm, lm.tokenizer, "whole-prefix"

    def score(self, ids, mask=None, *, prompt_lengths=None, **flags):
        return self.lm.score(ids, mask, **flags)

    def next_token_logprobs(self, ids, mask=None):
        return self.lm.next_token_logprobs(ids, mask)


@pytest.fixture(scope="module")
def fuse(attack_world):
    return load_scorers(attack_world["bundle"], [FUSE, "none"])


def _fresh_by_hand(lm, seq):
    """log r(x_{t+1} | x_{<=t}) from one next_token_logprobs request per prefix."""
    ids = torch.tensor([seq])
    return torch.stack(
        [lm.next_token_logprobs(ids[:, : t + 1])[0, seq[t + 1]] for t in range(len(seq) - 1)]
    )


def test_every_position_is_a_fresh_request(fuse):
    lm = fuse[FUSE]
    seqs = [encode(lm.tokenizer, t) for t in TEXTS]
    got = batched_token_logprobs(lm, seqs, batch_size=2)
    old = batched_token_logprobs(WholePrefixPath(lm), seqs, batch_size=2)
    for s, g, o in zip(seqs, got, old, strict=True):
        by_hand = _fresh_by_hand(lm, s)
        torch.testing.assert_close(g, by_hand, rtol=1e-4, atol=1e-4)
        assert (o - by_hand).abs().max() > 1e-2  # the whole-prefix path is another model
    stats = batched_position_stats(lm, seqs, batch_size=2)
    for st, g in zip(stats, got, strict=True):
        np.testing.assert_allclose(st.token_logprobs, g.double().numpy(), rtol=1e-4, atol=1e-4)
        assert np.all(st.sigma >= 0) and np.all(st.mu <= 0)


def test_moments_of_the_next_token_distribution(fuse):
    lm = fuse["none"]
    seq = encode(lm.tokenizer, TEXTS[0])
    (st,) = batched_position_stats(lm, [seq])
    ids = torch.tensor([seq])
    full = score_requests(lm, ids, torch.ones_like(ids), full=True).logprobs[0].double()
    p = full.exp()
    mu = (p * full).sum(-1)
    sd = ((p * (full - mu[:, None]) ** 2).sum(-1)).sqrt()
    np.testing.assert_allclose(st.mu, mu.numpy(), rtol=1e-4)
    np.testing.assert_allclose(st.sigma, sd.numpy(), rtol=1e-3)


def test_tte_under_the_fresh_protocol_differs_from_the_whole_prefix_path(fuse):
    lm = fuse[FUSE]
    res = token_by_token_extraction(lm, TEXTS)
    old = token_by_token_extraction(WholePrefixPath(lm), TEXTS)
    conf = []
    for t in TEXTS:
        s = encode(lm.tokenizer, t)
        ids = torch.tensor([s])
        for k in range(1, len(s)):
            conf.append(float(lm.next_token_logprobs(ids[:, :k])[0].max().exp()))
    np.testing.assert_allclose(res.confidence, conf, rtol=1e-4)
    assert np.abs(old.confidence - res.confidence).max() > 1e-3


def test_exposure_scores_the_secret_as_the_continuation_of_its_prefix(fuse):
    lm = fuse[FUSE]
    space = CanarySpace(("alpha", "beta", "gamma", "delta"), n_words=2)
    canary = Canary("The secret words are:", ("beta", "gamma"), 1)
    res = canary_exposure(lm, [canary], space)
    prefix = encode(lm.tokenizer, canary.prefix)
    secret = encode(lm.tokenizer, space.render(canary.secret), add_special_tokens=False)
    ids = torch.tensor([prefix + secret])
    cont = lm.score(ids, prompt_lengths=[len(prefix)])[0, len(prefix) - 1 :]
    fresh = _fresh_by_hand(lm, prefix + secret)[len(prefix) - 1 :]
    assert res.logppl[0] == pytest.approx(-float(cont.sum()), rel=1e-4)
    assert abs(res.logppl[0] + float(fresh.sum())) > 1e-3  # the two protocols differ here


def test_lira_and_the_mia_suite_read_fresh_requests(fuse):
    lm, ref = fuse[FUSE], fuse["none"]
    members, non = [("Name: Ada,", " 12")], [("Name: Bob,", " 34")]
    res = lira(lm, ref, members, non)
    old = lira(WholePrefixPath(lm), ref, members, non)
    assert np.abs(res.scores - old.scores).max() > 1e-3
    mia = membership_inference(lm, members, non, reference=ref, base=ref)
    np.testing.assert_allclose(mia.scores.members["lira"], res.scores[:1], rtol=1e-6)


def test_a_continuation_is_scored_as_generate_produced_it(fuse):
    """Canary exposure's protocol: the prompt's tokens, then its continuation on CP-Fuse's path —
    exactly the log-probs ``generate`` returned for the tokens it produced."""
    lm = fuse[FUSE]
    prompt = "The secret words are:"
    (gen,) = lm.generate([prompt], max_new_tokens=6, temperature=0.0)
    p_ids = encode(lm.tokenizer, prompt)
    (cont,) = batched_token_logprobs(lm, [p_ids + gen.token_ids], prompt_lengths=[len(p_ids)])
    np.testing.assert_allclose(cont[len(p_ids) - 1 :].numpy(), gen.logprobs, rtol=1e-4, atol=1e-4)
    (fresh,) = batched_token_logprobs(lm, [p_ids + gen.token_ids])
    assert np.abs(fresh[len(p_ids) :].numpy() - gen.logprobs[1:]).max() > 1e-3
