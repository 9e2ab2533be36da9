"""scpdr._kernel: the fused C kernel of SCP-Δr against the torch implementation (the fast path
tested against the slow one), its build, cache and fallback."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scpdr import _kernel, naf
from scpdr.testing import extreme_logits

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler on PATH: scpdr uses the torch implementation (tested everywhere)",
)


def torch_path(x, base, m):
    return naf._scp_delta_r(x, base, m, components=False)[0]


def gap(x, base, m):
    """Distance between the m-th and (m+1)-th smoothing scores (min over rows, constituents):
    below float rounding, two implementations may keep different (equally valid) tokens."""
    sm = naf._smoothing(naf._check_logps(x, "t", min_k=1), base, m)
    score = torch.softmax(x.float(), -1).clamp_min(naf._PROB_FLOOR) * sm.d
    top = score.topk(m + 1, dim=-1).values
    return float((top[..., m - 1] - top[..., m]).min())


def test_the_kernel_builds_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.setattr(_kernel, "_STATE", {})
    fn = _kernel.scp_delta_r_kernel()
    assert fn is not None
    built = list((tmp_path / "kernels").glob("scp_delta_r-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(_kernel, "_STATE", {})
    assert _kernel.scp_delta_r_kernel() is not None  # loaded from the cache, not rebuilt
    assert list((tmp_path / "kernels").glob("scp_delta_r-*.so")) == built


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.integers(2, 4),
    rows=st.integers(1, 3),
    vocab=st.sampled_from([12, 100, 1023, 1025, 4096]),
    m=st.sampled_from([1, 3, 10]),
    scale=st.sampled_from([1.0, 4.0, 20.0]),
    constant_base=st.booleans(),
)
def test_kernel_equals_the_torch_implementation(seed, k, rows, vocab, m, scale, constant_base):
    assume(m < vocab)
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(rows, vocab, generator=g) * scale
    x = shared + torch.randn(k, rows, vocab, generator=g) * scale / 2
    base = shared + torch.randn(rows, vocab, generator=g)
    if constant_base:
        base = base[0]
    assume(gap(x, base, m) > 1e-6)
    fused = naf._scp_delta_r_fused(x, base, m)
    assert fused is not None
    want = torch_path(x, base, m)
    torch.testing.assert_close(fused, want, atol=2e-5, rtol=2e-6)
    assert torch.allclose(fused.exp().sum(-1), torch.ones(rows), atol=1e-5)


def test_kernel_at_the_real_vocabulary_and_batch_shapes():
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(2, 3, 49152, generator=g) * 3
    x = shared + torch.randn(2, 2, 3, 49152, generator=g)
    base = shared + torch.randn(2, 3, 49152, generator=g)
    out = naf.aggregate("scp-delta-r", x, base=base, m=10)
    assert out.shape == (2, 3, 49152)
    torch.testing.assert_close(out, torch_path(x, base, 10), atol=2e-5, rtol=0)


def test_kernel_handles_extremes_and_does_not_touch_its_inputs():
    x, base = extreme_logits()
    x0, b0 = x.clone(), base.clone()
    out = naf._scp_delta_r_fused(x, base, 10)
    assert out is not None and torch.isfinite(out).all()
    assert torch.allclose(out.exp().sum(-1), torch.ones(3), atol=1e-5)
    torch.testing.assert_close(out, torch_path(x, base, 10), atol=1e-4, rtol=0)
    assert torch.equal(x, x0) and torch.equal(base, b0)


def test_kernel_is_skipped_where_it_does_not_apply(monkeypatch):
    x = torch.randn(2, 1, 300, requires_grad=True)
    base = torch.randn(1, 300)
    assert naf._scp_delta_r_fused(x, base, 10) is None  # autograd: the torch path
    with torch.no_grad():
        assert naf._scp_delta_r_fused(x, base, 10) is not None
        assert naf._scp_delta_r_fused(x, base, _kernel.MAX_M + 1) is None
        big_k = torch.randn(_kernel.MAX_K + 1, 1, 300)
        assert naf._scp_delta_r_fused(big_k, base, 10) is None
    monkeypatch.setenv("SCPDR_NAF_KERNEL", "0")
    with torch.no_grad():
        assert naf._scp_delta_r_fused(x, base, 10) is None
        assert torch.equal(naf.scp_delta_r(x, base=base), torch_path(x, base, 10))


def test_a_failed_build_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(_kernel, "_STATE", {})
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "definitely-not-a-compiler")
    x, base = torch.randn(2, 2, 200), torch.randn(2, 200)
    with caplog.at_level(logging.WARNING, logger="scpdr._kernel"):
        out = naf.aggregate("scp-delta-r", x, base=base, m=5)
    assert "not available" in caplog.text and "definitely-not-a-compiler" in caplog.text
    assert torch.equal(out, torch_path(x, base, 5))


def test_the_packed_gemm_kernel_builds_is_cached_and_falls_back(monkeypatch, tmp_path, caplog):
    """resources/packed_gemm.c builds into its own cached library; with no compiler the LoRA
    fast path keeps torch's matmuls after one warning."""
    from scpdr import lora_fast, testing

    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.setattr(_kernel, "_STATE", {})
    assert _kernel.packed_gemm_kernel() is not None
    built = sorted((tmp_path / "kernels").glob("packed_gemm-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(_kernel, "_STATE", {})
    assert _kernel.packed_gemm_kernel() is not None  # loaded from the cache, not rebuilt
    assert sorted((tmp_path / "kernels").glob("packed_gemm-*.so")) == built
    monkeypatch.setattr(_kernel, "_STATE", {})
    monkeypatch.setenv("CC", "definitely-not-a-compiler")
    model = testing.tiny_model(0, num_layers=1)
    name = "model.layers.0.self_attn.q_proj"
    adapter = testing.random_lora_adapter(model, name, rank=2)
    with caplog.at_level(logging.WARNING, logger="scpdr._kernel"):
        stack = lora_fast.StackedLoRA(model, [adapter, None], ["a", "base"])
    assert "packed CPU matmul kernel is not available" in caplog.text
    assert stack.model.get_submodule(name).weight_packed is None


def test_packed_gemm_without_openmp_builds_single_threaded(monkeypatch, tmp_path, caplog):
    """A compiler without OpenMP (e.g. clang with no libomp): the kernel is built without
    -fopenmp and still loads (the parallel pragmas are ignored; results are the same)."""
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.setattr(_kernel, "_STATE", {})
    real_build = _kernel._build

    def build(name, source, compiler, extra=()):
        if "-fopenmp" in extra:
            raise RuntimeError("cc: error: unsupported option '-fopenmp'")
        return real_build(name, source, compiler, extra)

    monkeypatch.setattr(_kernel, "_build", build)
    with caplog.at_level(logging.INFO, logger="scpdr._kernel"):
        lib = _kernel.packed_gemm_kernel()
    assert lib is not None and "building it single-threaded" in caplog.text
    x, w = torch.randn(7, 40), torch.randn(70, 40)
    from scpdr.lora_fast import pack_panels

    packed, y = pack_panels(w), torch.empty(7, 70)
    lib.scpdr_gemm_packed_f32(
        7, 70, 40, x.data_ptr(), 40, packed.data_ptr(), y.data_ptr(), 70, 0, 2
    )
    torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-4)
