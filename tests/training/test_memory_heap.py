"""The heap of a CPU training run: :func:`scpdr.training.memory.trim_heap` hands freed heap pages
back to the system (glibc), where plain ``free`` keeps them resident."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

import pytest

from scpdr.training import memory
from scpdr.training.memory import heap_free_bytes, heap_trim_callback, trim_heap, trim_step_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap"
)


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_heap_blocks_go_back_to_the_system_only_when_trimmed():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    size, n = 64 * 1024, 1600  # 100 MiB in blocks below the mmap threshold: on the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for b in blocks[:-1]:  # the last block pins the heap's top: free alone returns nothing
        libc.free(b)
    before = _rss_bytes()
    assert trim_heap(collect=True)
    after = _rss_bytes()
    libc.free(blocks[-1])
    assert before - after > 0.8 * size * (n - 1)  # the freed 100 MiB left the process


def _freed_pinned_heap(libc, size: int = 64 * 1024, n: int = 1600):
    """``n`` resident heap blocks of ``size`` bytes, all freed but the last (which pins the heap's
    top): resident until trimmed. Returns the pinning block (free it after the test) and the
    bytes freed."""
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:
        libc.free(b)
    return blocks[-1], size * (n - 1)


def test_a_trim_is_skipped_below_its_minimum_of_free_heap():
    """trim_heap(min_free=...) reads the heap's free bytes (which count what was just freed) and
    trims only from that much: below it the freed blocks stay resident."""
    if heap_free_bytes() is None:
        pytest.skip("this glibc has no mallinfo2")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    pin, freed = _freed_pinned_heap(libc)  # 100 MiB
    free = heap_free_bytes()
    assert free >= freed
    before = _rss_bytes()
    assert not trim_heap(min_free=free + (1 << 30))
    kept = _rss_bytes()
    assert trim_heap(min_free=free // 2)
    after = _rss_bytes()
    libc.free(pin)
    assert before - kept < 0.2 * freed  # skipped: still resident
    assert kept - after > 0.8 * freed  # trimmed


@pytest.fixture
def step_minimum(monkeypatch):
    """Sets the free heap a trim inside a step needs (``memory.STEP_TRIM_MIN_FREE``, read at
    each call): below or above the tests' 100 MiB of freed blocks."""
    if heap_free_bytes() is None:
        pytest.skip("this glibc has no mallinfo2: every step's trim runs")

    def set_to(nbytes: int) -> None:
        monkeypatch.setattr(memory, "STEP_TRIM_MIN_FREE", nbytes)

    return set_to


def test_a_step_trim_is_skipped_where_the_heap_holds_less_than_its_minimum(step_minimum):
    """Below STEP_TRIM_MIN_FREE of free heap the step's trims (the callback's, the chunked
    loss's) leave the freed blocks resident."""
    from types import SimpleNamespace

    import torch

    from scpdr.training.loss import ChunkedCausalLMLoss

    step_minimum(heap_free_bytes() + (1 << 40))
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    pin, freed = _freed_pinned_heap(libc)
    before = _rss_bytes()
    assert not trim_step_heap()
    heap_trim_callback().on_pre_optimizer_step(None, None, None)
    head = torch.nn.Linear(8, 50, bias=False)
    out = SimpleNamespace(hidden_states=(torch.randn(2, 6, 8),))
    ChunkedCausalLMLoss(head, vocab_size=50, trim_heap=True)(out, torch.zeros(2, 6).long())
    dropped = before - _rss_bytes()
    libc.free(pin)
    assert dropped < 0.2 * freed


def test_the_step_callback_returns_freed_heap_blocks(step_minimum):
    """The Trainer callback of a CPU run hands the heap's free blocks back before each
    optimizer step (the chunked loss does after the forward), where the heap holds at least
    STEP_TRIM_MIN_FREE free (here set below the 100 MiB freed)."""
    step_minimum(50 << 20)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    cb = heap_trim_callback()
    pin, freed = _freed_pinned_heap(libc)
    before = _rss_bytes()
    cb.on_pre_optimizer_step(None, None, None)
    after = _rss_bytes()
    libc.free(pin)
    assert before - after > 0.8 * freed


def test_the_chunked_loss_trims_first_and_computes_the_same_loss(step_minimum):
    """ChunkedCausalLMLoss(trim_heap=True) returns the heap's free blocks before its chunks
    and gives the loss and gradients of trim_heap=False, bit for bit."""
    from types import SimpleNamespace

    import torch

    from scpdr.training.loss import ChunkedCausalLMLoss

    step_minimum(50 << 20)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (2, 6), generator=gen)
    out = SimpleNamespace(hidden_states=(hidden,))
    results = []
    for trim in (False, True):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        pin, freed = _freed_pinned_heap(libc)
        before = _rss_bytes()
        loss = ChunkedCausalLMLoss(head, vocab_size=50, trim_heap=trim)(out, labels)
        dropped = before - _rss_bytes()
        libc.free(pin)
        (grad,) = torch.autograd.grad(loss, [hidden])
        results.append((loss.detach(), grad))
        assert (dropped > 0.8 * freed) is trim
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_cpu_trainer_trims_the_heap_inside_each_step(tmp_path):
    """make_trainer(trim_heap=True) (finetune on CPU) registers the step callback and makes
    the chunked loss trim after the forward; without it, neither."""
    from transformers import TrainingArguments

    from scpdr.testing import tiny_model
    from scpdr.training.sequences import CausalCollator
    from scpdr.training.trainer import make_trainer

    rows = [{"input_ids": [3, 4, 5, 2], "attention_mask": [1] * 4, "labels": [3, 4, 5, 2]}] * 2
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False
    )
    kind = type(heap_trim_callback())
    for trim in (True, False):
        trainer, chunked = make_trainer(
            model=tiny_model(0).train(), args=args, rows=rows,
            collator=CausalCollator(pad_token_id=2), grouped=False, chunked_loss=True,
            autocast=None, trim_heap=trim,
        )  # fmt: skip
        assert chunked and trainer.compute_loss_func.trim_heap is trim
        assert any(isinstance(cb, kind) for cb in trainer.callback_handler.callbacks) is trim


def test_a_bf16_cpu_training_step_keeps_no_cache_of_weight_casts(tmp_path):
    """The Trainer's bf16 autocast on CPU runs the model's forward with autocast's weight
    cache off (scpdr.training.memory.AUTOCAST_CACHE): what the model sees inside a step."""
    import torch
    from transformers import TrainingArguments

    from scpdr.testing import tiny_model
    from scpdr.training.sequences import CausalCollator
    from scpdr.training.trainer import make_trainer

    rows = [{"input_ids": [3, 4, 5, 2], "attention_mask": [1] * 4, "labels": [3, 4, 5, 2]}] * 2
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, max_steps=1, report_to="none",
        remove_unused_columns=False, save_strategy="no", per_device_train_batch_size=2,
    )  # fmt: skip
    model = tiny_model(0).train()
    seen = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append(
            (torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled())
        )
    )
    trainer, _ = make_trainer(
        model=model, args=args, rows=rows, collator=CausalCollator(pad_token_id=2),
        grouped=False, chunked_loss=True, autocast="cpu", trim_heap=False,
    )  # fmt: skip
    seen.clear()  # (make_trainer checks the head on a forward outside training)
    trainer.train()
    assert seen and all(seen_ == (True, False) for seen_ in seen)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trims_come_before_every_nth_layers_forward_and_after_its_backward_once(
    monkeypatch, checkpointing
):
    """trim_at_layers(model, every=2) on 5 decoder layers: in the forward one trim just before
    layers 2 and 4 run (none before layer 0: the step's start), in the backward one after each
    of layers 4, 2 and 0 has its gradients (not before, not twice under checkpointing's
    recompute); all where the heap holds enough free but the last (layer 0's, the backward's
    end), which runs always; none in a forward without gradients or once the hooks are
    removed, and the same gradients as without the hooks."""
    import torch

    from scpdr import testing

    model = testing.tiny_model(0, num_layers=5).train()
    if checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    layers = list(model.model.layers)
    seen: list[list[bool]] = []

    kinds: list[str] = []
    ran: list[int] = []  # the layers' forwards, in order (recomputes included)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda _m, _a, _o, i=i: ran.append(i))
    before: list[int] = []

    def fake(kind: str) -> Any:
        def trim(**_kw: Any) -> bool:  # which layers have their gradients when the trim runs
            seen.append([layer.mlp.down_proj.weight.grad is not None for layer in layers])
            kinds.append(kind)
            before.append(len(ran))
            return False

        return trim

    monkeypatch.setattr(memory, "trim_step_heap", fake("step"))
    monkeypatch.setattr(memory, "trim_heap", fake("always"))
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))

    def grads() -> list:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    handles = memory.trim_at_layers(model, every=2)
    ran.clear()
    hooked = grads()
    assert [[i for i, g in enumerate(s) if g] for s in seen] == [
        [], [], [4], [2, 3, 4], [0, 1, 2, 3, 4]
    ]  # fmt: skip
    assert before[:2] == [2, 4]  # in the forward: after layers 0-1, then 0-3 ran
    # the embeddings are trained: always at the end
    assert kinds == ["step", "step", "step", "step", "always"]
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    grads()
    assert seen == []
    # frozen input embeddings with their output in the graph (here through a scaling): no
    # V x H gradient comes last, so the last trim keeps the threshold
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_input_embeddings().register_forward_hook(
        lambda _m, _a, out: out.requires_grad_(True) * 1.0
    )
    handles = memory.trim_at_layers(model, every=2)
    kinds.clear()
    grads()
    for h in handles:
        h.remove()
    assert kinds == ["step"] * 5


def test_the_callback_installs_the_backward_trims_for_training_only(monkeypatch):
    """heap_trim_callback() hooks the model's layers at the start of training (once, also when
    told twice) and removes its hooks at the end: a backward of 3 layers trims once (after layer
    0's: every 10th layer, and the backward's last) while training, never after."""
    import torch

    from scpdr import testing

    trims = []
    monkeypatch.setattr(memory, "trim_heap", lambda **_kw: trims.append(1) or False)
    model = testing.tiny_model(0, num_layers=3).train()
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    cb = heap_trim_callback()
    counts = []
    for event in ("on_train_begin", "on_train_begin", "on_train_end"):
        getattr(cb, event)(None, None, None, model=model)
        trims.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        counts.append(len(trims))
    assert counts == [1, 1, 0]
