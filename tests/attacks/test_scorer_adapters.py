"""The scorer output adapters read a field under any of its usual names, first match wins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scpdr.attacks.scorer import _greedy_of, _split_components


def test_greedy_of_reads_ids_and_logprobs_under_their_aliases():
    ids, lp, tl = torch.tensor([[1, 2]]), torch.tensor([[-0.5, -1.0]]), torch.tensor([[-9.0, -9.0]])
    for ids_name in ("token_ids", "ids", "tokens"):
        got_ids, got_lp = _greedy_of({"greedy": {ids_name: ids, "token_logprobs": tl}})
        assert got_ids is ids and got_lp is tl
    # "logprobs" comes before "token_logprobs"; "token_ids" before "ids"
    out = SimpleNamespace(
        greedy=SimpleNamespace(token_ids=ids, ids=tl, logprobs=lp, token_logprobs=tl)
    )
    got_ids, got_lp = _greedy_of(out)
    assert got_ids is ids and got_lp is lp
    got_ids, got_lp = _greedy_of({"greedy": {"ids": ids}})
    assert got_ids is ids and got_lp is None


def test_split_components_reads_constituents_and_base_under_their_aliases():
    logps, base = torch.zeros(2, 1, 3, 4), torch.ones(1, 3, 4)
    for name in ("constituents", "logps", "constituent_logprobs"):
        for base_name in ("base", "base_logprobs"):
            got, got_base = _split_components({name: logps, base_name: base})
            assert got is logps and got_base is base
    got, got_base = _split_components(SimpleNamespace(logps=[logps[0], logps[1]], base=None))
    assert torch.equal(got, logps) and got_base is None
    with pytest.raises(TypeError, match="cannot read components"):
        _split_components({"other": logps})
