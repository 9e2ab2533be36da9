"""Built-in corpora: deterministic, non-empty on this machine's stdlib, the documented formats."""

from __future__ import annotations

import re

import pytest

from scpdr.data.corpora import CORPORA, build_corpus, names2ids, pycode, pydocs
from scpdr.data.records import DataError


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_corpus_is_deterministic_and_non_empty(name: str):
    a = build_corpus(name, n_train=12, n_val=4, seed=3)
    b = build_corpus(name, n_train=12, n_val=4, seed=3)
    c = build_corpus(name, n_train=12, n_val=4, seed=4)
    assert a.train == b.train and a.validation == b.validation
    assert [r.text for r in a.train] != [r.text for r in c.train]
    assert len(a.train) == 12 and len(a.validation) == 4
    texts = [r.text for r in a.train + a.validation]
    assert len(set(texts)) == len(texts)
    ids = [r.id for r in a.train + a.validation]
    assert len(set(ids)) == len(ids)
    for r in a.train + a.validation:
        assert r.prompt and r.response and r.text == r.prompt + r.response


def test_names2ids_format_and_uniqueness():
    c = names2ids(n_train=300, n_val=50, seed=0)
    names, digits = set(), set()
    for r in c.train + c.validation:
        m = re.fullmatch(r"Name: (.+), ID:", r.prompt)
        assert m, r.prompt
        assert re.fullmatch(r" \d{10}", r.response)
        names.add(m.group(1))
        digits.add(r.response)
    assert len(names) == len(digits) == 350
    # several locales: some names carry non-ASCII (latin-script) letters
    assert any(not n.isascii() for n in names)


def test_pycode_and_pydocs_formats():
    code = pycode(n_train=5, n_val=0, seed=1)
    for r in code.train:
        assert r.prompt.startswith("Instruction: ") and r.prompt.endswith("\nCode:\n")
        assert r.response.lstrip().startswith(("def ", "async def ")) or "def " in r.response
        compile(r.response, "<pycode>", "exec")  # the response is valid Python
        assert '"""' not in r.response.split("\n", 2)[1]  # docstring removed
    docs = pydocs(n_train=5, n_val=0, seed=1)
    for r in docs.train:
        assert r.prompt.startswith("Title: ") and r.prompt.endswith("\nAbstract:")
        assert len(r.response) >= 300 and ">>>" not in r.response


def test_unknown_corpus_and_bad_sizes():
    with pytest.raises(DataError, match="unknown corpus 'nope'"):
        build_corpus("nope", n_train=1, n_val=0)
    with pytest.raises(DataError, match="n_train >= 1"):
        names2ids(n_train=0, n_val=1)
