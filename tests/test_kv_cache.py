"""The buffered KV cache layer (scpdr.runtime.kv_cache) against transformers' DynamicLayer: the
same keys and values after any sequence of updates and of the operations that replace them,
buffers re-allocated only when full, and protected decoding (general and LoRA fast path) that
gives the same tokens and log-probs bit for bit with the buffer as with concatenation."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from scpdr import models, testing
from scpdr.lora import save_random_lora
from scpdr.runtime import ProtectedLM, kv_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: (op, argument): "add" n new tokens; "crop" n tokens off the end; "select" rows (a bitmask of
#: the batch's rows, at least one kept); "trim" the first n columns (as Decoder.select assigns
#: keys); "reset".
OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 9)),
    st.tuples(st.just("add"), st.just(1)),
    st.tuples(st.just("crop"), st.integers(1, 3)),
    st.tuples(st.just("select"), st.integers(1, 7)),
    st.tuples(st.just("trim"), st.integers(1, 3)),
    st.tuples(st.just("reset"), st.just(0)),
)


def _apply(layer, op: str, n: int, gen: torch.Generator, rows: int):
    """One operation on ``layer``; returns what an update returned (or None) and the rows."""
    held = layer.get_seq_length()
    if op == "add":
        k = torch.randn(rows, 2, n, 4, generator=gen)
        v = torch.randn(rows, 2, n, 4, generator=gen)
        return layer.update(k, v), rows
    if op == "crop" and held > n:
        layer.crop(-n)
    elif op == "select" and held:
        keep = [i for i in range(rows) if n >> i & 1] or [0]
        layer.batch_select_indices(torch.tensor(keep))
        return None, len(keep)
    elif op == "trim" and held > n:
        layer.keys, layer.values = layer.keys[:, :, n:], layer.values[:, :, n:]
    elif op == "reset":
        layer.reset()
    return None, rows


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=40), buffer_from=st.sampled_from([1, 5, 12]))
def test_buffered_layer_equals_dynamic_layer(ops, buffer_from):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache, "BUFFER_FROM", buffer_from)
        _check_against_dynamic_layer(ops)


def _check_against_dynamic_layer(ops) -> None:
    buffered, plain = kv_cache.layer_class()(), DynamicLayer()
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    rows = [3, 3]
    for op, n in ops:
        got, rows[0] = _apply(buffered, op, n, gens[0], rows[0])
        want, rows[1] = _apply(plain, op, n, gens[1], rows[1])
        assert buffered.get_seq_length() == plain.get_seq_length()
        if want is not None:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if plain.is_initialized and plain.get_seq_length():
            assert torch.equal(buffered.keys, plain.keys)
            assert torch.equal(buffered.values, plain.values)


def test_long_cache_is_written_in_place():
    """From BUFFER_FROM tokens on, a step writes into the buffer: the keys stay views of one
    allocation until it is full (then one copy into a buffer with SPARE_FRACTION to spare), so
    100 steps from BUFFER_FROM tokens move to a new buffer twice (from 256), not 100 times
    as concatenation does."""
    layer = kv_cache.layer_class()()
    start = kv_cache.BUFFER_FROM
    layer.update(torch.zeros(2, 3, start, 8), torch.zeros(2, 3, start, 8))
    ptrs = []
    for step in range(100):
        k, v = torch.full((2, 3, 1, 8), float(step)), torch.full((2, 3, 1, 8), -float(step))
        keys, values = layer.update(k, v)
        ptrs.append(keys.data_ptr())
        assert keys.shape[-2] == start + step + 1
        assert torch.equal(keys[:, :, -1:], k) and torch.equal(values[:, :, -1:], v)
    spare = kv_cache.SPARE_MIN, kv_cache.SPARE_FRACTION
    room, n = start + max(spare[0], int(start * spare[1])), 0
    while room < start + 100:  # the re-allocations that room allows
        room = room + 1 + max(spare[0], int((room + 1) * spare[1]))
        n += 1
    moves = sum(a != b for a, b in itertools.pairwise(ptrs))
    assert moves == n <= 5
    assert torch.equal(layer.keys[:, :, start:, 0], torch.arange(100.0).expand(2, 3, 100))


@pytest.fixture(scope="module")
def lora_bundle(tmp_path_factory):
    """A tiny base and two random LoRA adapters over it, bundled (the fast path runs them)."""
    root = tmp_path_factory.mktemp("kv")
    tok, base = testing.tiny_tokenizer(), testing.tiny_model(0)
    base.save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    lora = {"base_ref": "../base", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    refs = [save_random_lora(base, root / f"a{i}", seed=i, std=0.3, **lora) for i in range(2)]
    return models.write_bundle(root / "bundle", base=root / "base", constituents=refs)


@pytest.fixture(scope="module")
def full_bundle(tmp_path_factory):
    return testing.make_tiny_bundle(tmp_path_factory.mktemp("kvf") / "bundle")


@pytest.mark.parametrize("which", ["lora_bundle", "full_bundle"])
def test_decoding_is_the_same_with_buffered_caches(request, monkeypatch, which):
    """Rows of different lengths finishing at different steps (Decoder.select trims the caches)
    give the same tokens, log-probs and certificates whether the caches concatenate or write
    in place: the fast path's stacked cache and the general runner's caches."""
    lm = ProtectedLM.from_bundle(request.getfixturevalue(which), method="scp-delta-r")
    assert lm.fast_path.on == (which == "lora_bundle")
    caches = lm.runner.new_caches()  # the runner protocol: what decoding fills
    assert caches and all(c.layer_class_to_replicate is kv_cache.layer_class() for c in caches)
    prompts = ["My secret code is", "Hello there, how are you doing on this fine day", "x"]
    n = [12, 5, 9]
    out = {}
    for buffer_from in (10**9, 3):
        monkeypatch.setattr(kv_cache, "BUFFER_FROM", buffer_from)
        out[buffer_from] = lm.generate(prompts, max_new_tokens=n, stop_at_eos=False)
    for a, b, k in zip(out[10**9], out[3], n, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == k
        assert a.logprobs == b.logprobs and a.k_x == b.k_x and a.t_x == b.t_x
