"""The scorer output adapters: a ``components`` output read under its usual shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scpdr.attacks.scorer import split_components


def test_split_components_reads_constituents_and_base_under_their_aliases():
    logps, base = torch.zeros(2, 1, 3, 4), torch.ones(1, 3, 4)
    for name in ("constituents", "logps"):
        got, got_base = split_components({name: logps, "base": base})
        assert got is logps and got_base is base
    got, got_base = split_components((logps, base))
    assert got is logps and got_base is base
    got, got_base = split_components(SimpleNamespace(logps=[logps[0], logps[1]], base=None))
    assert torch.equal(got, logps) and got_base is None
    with pytest.raises(TypeError, match="cannot read components"):
        split_components({"other": logps})
