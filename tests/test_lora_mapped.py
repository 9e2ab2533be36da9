"""scpdr.lora.mapped and CheckpointWeights.holds: a module weight that is still the checkpoint's
own memory-mapped bytes is recognized from the process's maps and page table, without reading it,
so that building the fast path pages in none of the model's own weights; a written view, a copy
or another tensor of the file is not taken for it."""

from __future__ import annotations

import mmap
import os
import platform
import struct

import pytest
import torch
from safetensors.torch import save_file

from scpdr import kernels, models, testing
from scpdr.lora import StackedLoRA, checkpoint_weight_source, mapped

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux", reason="/proc/self/pagemap is Linux's (elsewhere: None)"
)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def present_pages(addr: int, nbytes: int) -> set[int]:
    """Pages of ``[addr, addr + nbytes)`` mapped in this process now (pagemap bit 63)."""
    first, last = addr // PAGE, (addr + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        raw = fh.read((last - first + 1) * 8)
    return {first + i for i, (e,) in enumerate(struct.iter_unpack("<Q", raw)) if e >> 63 & 1}


def _maps_name_files(tmp_path) -> bool:
    """Whether this filesystem's /proc/self/maps entries match stat() (device and inode, or
    inode and path). Overlayfs before Linux 6.8 names the underlying file: ``holds`` then says
    None everywhere and the fast path reads rows as before, which these tests cannot check."""
    path = tmp_path / "probe.safetensors"
    save_file({"w": torch.ones(1024, 8)}, str(path))
    with open(path, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        first, end, _, _ = mapped.tensor_offsets(path)["w"]
        t = torch.frombuffer(mm, dtype=torch.float32, count=(end - first) // 4, offset=first)
        found = mapped.holds(t.view(1024, 8), path, "w")
        del t
        mm.close()
    return found is True


@pytest.fixture(autouse=True)
def _needs_mapped_files(tmp_path):
    if not _maps_name_files(tmp_path):
        pytest.skip("/proc/self/maps does not name this filesystem's files as stat() does")


@pytest.fixture
def mapped_file(tmp_path):
    """A safetensors file (a small tensor, then a 4 MiB one) and its tensors as views of a
    private writable mapping, as transformers maps a checkpoint."""
    path = tmp_path / "model.safetensors"
    big = torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)
    save_file({"a.weight": torch.ones(3, 5), "b.weight": big}, str(path))
    fh = open(path, "r+b")
    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    offsets = mapped.tensor_offsets(path)

    def view(key, dtype=torch.float32):
        first, end, _, shape = offsets[key]
        t = torch.frombuffer(mm, dtype=dtype, count=(end - first) // dtype.itemsize, offset=first)
        return t.view(*shape) if dtype == torch.float32 else t

    yield path, view, big
    del view
    try:
        mm.close()
    except BufferError:  # a view still alive: closed with the process
        pass
    fh.close()


def test_an_unwritten_view_is_recognized_without_being_read(mapped_file):
    path, view, big = mapped_file
    w = view("b.weight")
    before = present_pages(w.data_ptr(), w.numel() * 4)
    assert mapped.holds(w, path, "b.weight") is True
    assert present_pages(w.data_ptr(), w.numel() * 4) == before  # nothing paged in
    assert torch.equal(w, big)


def test_a_written_view_a_copy_or_another_tensor_is_not_the_checkpoints(mapped_file):
    path, view, _ = mapped_file
    w = view("b.weight")
    assert mapped.holds(w, path, "a.weight") is None  # another key: other offset and shape
    assert mapped.holds(w.clone(), path, "b.weight") is None  # not a view of the file
    assert mapped.holds(view("b.weight", torch.int32).view(1024, 1024), path, "b.weight") is None
    assert mapped.holds(w[1:], path, "b.weight") is None  # shape
    assert mapped.holds(w, path.with_name("missing.safetensors"), "b.weight") is None
    w[700, 3] += 1.0  # one page becomes the process's own copy
    assert mapped.holds(w, path, "b.weight") is False
    assert mapped.holds(view("a.weight"), path, "a.weight") is True  # other pages unaffected


def test_a_file_replaced_since_it_was_mapped_is_not_the_checkpoint(mapped_file):
    """A checkpoint written anew at the same path (atomically: another inode) after the model
    mapped the old one: the mapping is of a deleted file, so nothing is vouched for."""
    path, view, big = mapped_file
    a = view("a.weight")
    assert mapped.holds(a, path, "a.weight") is True
    tmp = path.with_name("new.safetensors")
    save_file({"a.weight": torch.zeros(3, 5), "b.weight": big}, str(tmp))
    os.replace(tmp, path)
    assert mapped.holds(a, path, "a.weight") is None


def test_transformers_loaded_weights_are_the_checkpoints_mapped_bytes(tmp_path):
    """What the fast path relies on: a model loaded by scpdr.models.load_model keeps its linears
    as unwritten views of model.safetensors (if a transformers version stops mapping it, holds
    says None and the fast path falls back to reading rows: this test says so)."""
    testing.tiny_model(0).save_pretrained(str(tmp_path))
    model = models.load_model(tmp_path)
    source = checkpoint_weight_source(tmp_path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    own = [n for n in linears if n != "lm_head"]  # a tied head is stored as the embeddings
    assert own and all(source.holds(n, linears[n].weight) is True for n in own)
    with torch.no_grad():
        linears[own[0]].weight.mul_(2.0)
    assert source.holds(own[0], linears[own[0]].weight) is False


def test_building_the_fast_path_pages_in_none_of_the_models_linears(tmp_path):
    """Every linear is re-laid out from the checkpoint's copy (packed for the C kernel, or
    chunked where wide for torch's matmuls) and none of the pages of the model's own weights
    that were not mapped before the build is mapped after it; the stack still computes the
    base's logits."""
    use_kernel = kernels.gemm.library() is not None
    model_kw = {"hidden_size": 64, "intermediate_size": 1200, "num_layers": 2, "vocab_size": 512}
    testing.tiny_model(1, **model_kw).save_pretrained(str(tmp_path))
    ref = models.load_model(tmp_path)
    model = models.load_model(tmp_path)
    relaid = {
        n: (m.weight.data_ptr(), m.weight.numel() * 4)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and (use_kernel or m.in_features > 576)
    }
    # interior pages only: a boundary page may hold a norm weight the model reads
    interior = {n: ((a + PAGE - 1) // PAGE, (a + s) // PAGE) for n, (a, s) in relaid.items()}
    before = {n: present_pages(a, s) for n, (a, s) in relaid.items()}
    adapter = testing.random_lora_adapter(model, "model.layers.0.mlp.up_proj", rank=2)
    stack = StackedLoRA(
        model, [adapter, None], ["a", "base"], weight_source=checkpoint_weight_source(tmp_path),
        use_kernel=use_kernel,
    )  # fmt: skip
    for n, (a, s) in relaid.items():
        lo, hi = interior[n]
        new = {p for p in present_pages(a, s) - before[n] if lo <= p < hi}
        assert not new, f"{n}: {len(new)} pages of its own weight paged in"
    ids = torch.randint(3, 500, (1, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = stack(ids, mask, (mask.cumsum(-1) - 1))[1]  # the base's group
        torch.testing.assert_close(out, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
