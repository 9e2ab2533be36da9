"""The ``naf`` object: per-token bounds as JSON carries them, maxima, streaming slices."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from scpdr import methods
from scpdr.serve.certificate import build_certificate, finite_or_none

SCP_B = methods.resolve("scp-delta-r")


def test_finite_or_none():
    assert finite_or_none(math.inf) is None and finite_or_none(math.nan) is None
    assert finite_or_none(0.25) == 0.25 and finite_or_none(None) is None


def _cert(k, t, **kw):
    return build_certificate(method=SCP_B.rule, m=10, name=SCP_B.name, k_x=k, t_x=t, **kw)


def test_certificate_maxima_and_infinite_bounds():
    c = _cert([0.1, 0.3, 0.2], [1.0, 0.5, 2.0])
    assert (c.max_k_x, c.max_t_x) == (0.3, 2.0)
    inf = _cert([0.1, math.inf], [1.0, math.inf])
    assert inf.k_x == [0.1, None] and inf.max_k_x is None and inf.max_t_x is None
    empty = _cert([], [])
    assert empty.max_k_x is None and empty.k_x == []
    echo = _cert([0.1], [1.0], prompt_k_x=[None, 0.7], prompt_t_x=[None, 3.0])
    assert (echo.max_k_x, echo.max_t_x) == (0.7, 3.0) and echo.prompt_k_x == [None, 0.7]


@given(st.lists(st.floats(0, 50), min_size=1, max_size=12))
def test_streamed_certificates_concatenate_to_the_whole(k):
    t = [2 * v for v in k]
    whole = _cert(k, t)
    parts = [_cert(k[: i + 1], t[: i + 1], listed=slice(i, i + 1)) for i in range(len(k))]
    assert [v for p in parts for v in p.k_x] == whole.k_x
    assert [v for p in parts for v in p.t_x] == whole.t_x
    assert [p.max_k_x for p in parts] == [max(k[: i + 1]) for i in range(len(k))]  # running
    assert parts[-1].max_t_x == whole.max_t_x == max(t)
