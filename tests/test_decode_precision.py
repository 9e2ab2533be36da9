"""The decoding precision of ``scpdr serve --precision auto`` on CPU (scpdr.serve.precision):
bf16 base weights only where the CPU has bf16 units and they are measured faster at batch 1
*and* 8; measured once per CPU model and kernel build, apart from the training precision."""

from __future__ import annotations

import json

import pytest
import torch

from scpdr import kernels
from scpdr.serve.config import ServeConfig
from scpdr.serve.precision import (
    DECODE_SHAPES,
    MIN_SPEEDUP,
    DecodeForm,
    decode_form,
    decode_layers,
    decode_micro_benchmark,
    measure_bytes,
    resolve_decode_precision,
)
from scpdr.training.precision import resolve_precision

pytestmark = pytest.mark.usefixtures("one_torch_thread")

UNITS = ["avx2", "avx512_bf16"]


def _timings(b1: float, b8: float):
    """bf16 ``b1``x / ``b8``x faster than fp32 at batch 1 / 8."""
    return [("decode step at batch 1", 1.0, b1), ("decode step at batch 8", 1.0, b8)]


def _never():
    raise AssertionError("measured")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh SCPDR_HOME, the suite's SCPDR_(DECODE_)PRECISION=fp32 lifted, no remembered
    decisions."""
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.delenv("SCPDR_PRECISION", raising=False)
    monkeypatch.delenv("SCPDR_DECODE_PRECISION", raising=False)
    kernels.reset()
    yield tmp_path
    kernels.reset()


def test_auto_needs_the_gain_at_both_batch_sizes(home):
    """The measured case: AMD Zen 4 (bf16 1.31x at batch 1, 0.94x at batch 8) keeps fp32; just
    under MIN_SPEEDUP at one batch size is not enough, at it is."""
    c = resolve_decode_precision("auto", flags=UNITS, measure=lambda: _timings(1.31, 0.94))
    assert c.precision == "fp32" and "0.94x" in c.reason and f"{MIN_SPEEDUP:g}x" in c.reason
    kernels.reset()
    (home / "kernels" / "precision.choices.json").unlink()
    edge = MIN_SPEEDUP - 0.01
    assert not resolve_decode_precision("auto", flags=UNITS, measure=lambda: _timings(2, edge)).bf16
    kernels.reset()
    (home / "kernels" / "precision.choices.json").unlink()
    at = MIN_SPEEDUP
    assert resolve_decode_precision("auto", flags=UNITS, measure=lambda: _timings(at, at)).bf16


def test_auto_takes_bf16_when_faster_everywhere_once_per_build(home):
    """Intel Xeon with AMX (1.49x / 1.39x): bf16, stored, read back without measuring; a
    separate decision per kernel build and apart from the training precision's."""
    first = resolve_decode_precision("auto", flags=UNITS, measure=lambda: _timings(1.49, 1.39))
    assert first.bf16 and "1.4x faster" in first.reason
    kernels.reset()  # a new process reads it back
    assert resolve_decode_precision("auto", flags=UNITS, measure=_never) == first
    with kernels.using_target("x86-64-v3"):  # the AVX2 build measures for itself
        assert not resolve_decode_precision(
            "auto", flags=UNITS, measure=lambda: _timings(1.0, 1.0)
        ).bf16
    with kernels.force("packed_gemm", "torch"):  # and so do torch's layers
        assert resolve_decode_precision(
            "auto", flags=UNITS, measure=lambda: _timings(1.2, 1.15)
        ).bf16
    training = resolve_precision("auto", flags=UNITS, measure=lambda: [("mm", 1.0, 1.0)])
    assert training.precision == "fp32"  # not the decoding decision
    [stored] = (home / "kernels").glob("precision*.json")
    heads = sorted(k.split("|")[0] for k in json.loads(stored.read_text()))
    decoding = [h for h in heads if h.startswith("decoding")]
    assert decoding == [
        "decoding (native build, packed GEMM by net gain, LoRA stack)",
        "decoding (native build, packed GEMM torch, LoRA stack)",
        "decoding (x86-64-v3 build, packed GEMM by net gain, LoRA stack)",
    ]
    assert len(heads) == 4  # and the training key (the CPU model first)


def test_each_decode_form_is_a_decision_of_its_own(home):
    """An Intel Xeon with AMX (family 6 model 167): bf16 panels 1.3x float32 panels for a LoRA
    stack, but 0.68x / 0.77x the GGUF base's Q4_1 blocks; full models over that base 0.99x /
    1.46x. Each form measures for itself, stores its decision, and reads it back."""
    forms = {
        DecodeForm(): (1.34, 1.33),
        DecodeForm(gguf_base=True): (0.68, 0.77),
        DecodeForm(stacked=False): (1.29, 1.90),
        DecodeForm(stacked=False, gguf_base=True): (0.99, 1.46),
    }
    got = {
        form: resolve_decode_precision(
            "auto", flags=UNITS, form=form, measure=lambda t=t: _timings(*t)
        ).precision
        for form, t in forms.items()
    }
    assert list(got.values()) == ["bf16", "fp32", "bf16", "fp32"]
    kernels.reset()  # a new process reads each back
    for form, precision in got.items():
        assert resolve_decode_precision(
            "auto", flags=UNITS, form=form, measure=_never
        ).precision == (precision)
    [stored] = (home / "kernels").glob("precision*.json")
    labels = {k.split("|")[0].rsplit(", ", 1)[-1] for k in json.loads(stored.read_text())}
    assert labels == {f"{form.label})" for form in forms}


def test_decode_form_of_a_bundle(tmp_path, monkeypatch):
    """LoRA adapters over one base: a stack (over a GGUF base where the adapters' base is a
    .gguf file); full models otherwise, with method 'none', or with the fast path off; a full
    bundle's GGUF base counts only where the method runs the base model."""
    from scpdr import models, testing
    from scpdr.lora import gguf_file, save_random_lora

    full = testing.make_tiny_bundle(tmp_path / "full", k=2)
    assert decode_form(full) == DecodeForm(stacked=False, gguf_base=False)
    assert decode_form(full, base="constant") == DecodeForm(stacked=False)
    base = models.load_model(full / "base")
    refs = [save_random_lora(base, tmp_path / f"a{i}", base_ref=str(full / "base"), seed=i)
            for i in range(2)]  # fmt: skip
    lora = models.write_bundle(tmp_path / "lora", base=full / "base", constituents=refs)
    assert decode_form(lora) == DecodeForm(stacked=True, gguf_base=False)
    assert decode_form(lora, method="none") == DecodeForm(stacked=False)
    monkeypatch.setenv("SCPDR_LORA_FAST", "0")
    assert decode_form(lora) == DecodeForm(stacked=False)
    monkeypatch.delenv("SCPDR_LORA_FAST")
    # the adapters' base a GGUF file: float32 would decode it from its Q4_1 blocks
    gguf = tmp_path / "base.gguf"
    gguf.write_bytes(b"GGUF")
    for ref in refs:
        cfg_file = ref / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": str(gguf)}))
    assert decode_form(lora) == DecodeForm(stacked=True, gguf_base=True)
    assert gguf_file(gguf) == gguf and gguf_file(full / "base") is None
    assert DecodeForm(stacked=True, gguf_base=True).label == "LoRA stack over a GGUF base"


def test_the_layers_timed_are_those_each_form_decodes_with(home):
    """With the packed kernel on: a LoRA stack's base in float32 panels, bf16 panels, or (a GGUF
    base in float32) Q4_1 blocks; full models on torch's matmuls in the dtype, but a float32
    GGUF base (the last model) on its blocks."""
    gemm = kernels.gemm.library()
    if not (gemm and gemm.tiled):
        pytest.skip("no C compiler: no packed kernel here")
    n = len(DECODE_SHAPES)
    with kernels.force("packed_gemm", "kernel"):

        def formats(form, dtype):
            layers, x_dtype = decode_layers(form, dtype, copies=3)
            kinds = [
                lin.weight_format if lin.weight_packed is not None else f"torch {lin.weight.dtype}"
                for lin in layers
            ]
            return kinds, x_dtype

        assert formats(DecodeForm(), torch.float32) == (["float32"] * 3 * n, torch.float32)
        assert formats(DecodeForm(), torch.bfloat16) == (["bf16"] * 3 * n, torch.float32)
        assert formats(DecodeForm(gguf_base=True), torch.float32) == (
            ["q4_1"] * 3 * n,
            torch.float32,
        )
        assert formats(DecodeForm(gguf_base=True), torch.bfloat16)[0] == ["bf16"] * 3 * n
        full32 = ["torch torch.float32"] * 2 * n
        assert formats(DecodeForm(stacked=False), torch.float32) == (
            full32 + ["torch torch.float32"] * n,
            torch.float32,
        )
        assert formats(DecodeForm(stacked=False, gguf_base=True), torch.float32) == (
            full32 + ["q4_1"] * n,
            torch.float32,
        )
        assert formats(DecodeForm(stacked=False, gguf_base=True), torch.bfloat16) == (
            ["torch torch.bfloat16"] * 3 * n,
            torch.bfloat16,
        )


def test_nothing_is_measured_without_bf16_units_or_for_an_explicit_precision(home):
    assert resolve_decode_precision("auto", flags=["avx2", "fma"], measure=_never).precision == (
        "fp32"
    )
    assert resolve_decode_precision("bf16", flags=UNITS, measure=_never).bf16
    assert resolve_decode_precision("fp32", flags=UNITS, measure=_never).precision == "fp32"
    assert resolve_decode_precision("auto", device="cuda", measure=_never).bf16 == (
        torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    )


def test_serve_auto_follows_the_decision_and_cuda_keeps_its_default(home, monkeypatch):
    monkeypatch.setenv("SCPDR_DECODE_PRECISION", "bf16")  # replaces the measurement
    assert ServeConfig().model_dtype("cpu") is torch.bfloat16
    assert ServeConfig(precision="fp32").model_dtype("cpu") is torch.float32  # explicit wins
    assert ServeConfig().model_dtype("cuda") is None  # from_bundle's CUDA default: bf16
    monkeypatch.setenv("SCPDR_DECODE_PRECISION", "fp32")
    assert ServeConfig().model_dtype("cpu") is None  # the checkpoint's float32
    assert ServeConfig(precision="bf16").model_dtype("cpu") is torch.bfloat16


def test_eval_and_serve_resolve_precision_alike(home, monkeypatch):
    """``scpdr eval --precision`` and ``scpdr serve --precision`` load the models in the same
    dtype (one resolver, :func:`scpdr.serve.precision.decode_dtype`)."""
    from scpdr.serve.precision import decode_dtype

    for decided in ("bf16", "fp32"):
        monkeypatch.setenv("SCPDR_DECODE_PRECISION", decided)
        for precision in ("auto", "fp32", "bf16"):
            for device in ("cpu", "cuda"):
                want = ServeConfig(precision=precision).model_dtype(device)
                assert decode_dtype(precision, device) is want
    monkeypatch.setenv("SCPDR_DECODE_PRECISION", "bf16")
    assert decode_dtype("auto", "cpu") is torch.bfloat16


def test_training_precision_variable_does_not_set_the_serving_one(home, monkeypatch):
    """SCPDR_PRECISION=bf16 (training) leaves serving's auto to its own measurement."""
    monkeypatch.setenv("SCPDR_PRECISION", "bf16")
    c = resolve_decode_precision("auto", flags=UNITS, measure=lambda: _timings(1.0, 1.0))
    assert c.precision == "fp32" and "micro-benchmark" in c.reason
    monkeypatch.setenv("SCPDR_DECODE_PRECISION", "bf16")
    assert resolve_decode_precision("auto", flags=UNITS, measure=_never).reason == (
        "SCPDR_DECODE_PRECISION=bf16"
    )


@pytest.mark.parametrize("side", ["kernel", "torch"])
@pytest.mark.parametrize("form", [DecodeForm(), DecodeForm(stacked=False, gguf_base=True)])
def test_micro_benchmark_times_a_decode_step_at_batch_1_and_8(home, side, form):
    """Both ways a stack runs bf16 weights: bf16 panels on the packed kernel, or torch's bf16
    layers where the kernel is not used; full models one after the other; finite, positive
    times for both batch sizes."""
    if side == "kernel" and not (kernels.gemm.library() and kernels.gemm.library().tiled):
        pytest.skip("no C compiler: no packed kernel here")
    with kernels.force("packed_gemm", side):
        timings = decode_micro_benchmark(repeats=1, weight_bytes=4 << 20, form=form)
    rows = (3, 24) if form.stacked else (1, 8)
    assert [w for w, _, _ in timings] == [
        f"decode step at batch 1 ({rows[0]} rows)",
        f"decode step at batch 8 ({rows[1]} rows)",
    ]
    assert all(b > 0 and f > 0 for _, b, f in timings)


def test_the_benchmark_streams_more_than_the_cache():
    assert 256 << 20 <= measure_bytes() <= 512 << 20


def test_the_decoding_precision_is_logged_once_per_process(tmp_path):
    """An experiment's plan resolves the precision once per evaluating stage: one log line."""
    import os
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from scpdr.serve.precision import decode_dtype\n"
        "for _ in range(3): decode_dtype('auto', 'cpu')\n"
    )
    env = {**os.environ, "SCPDR_HOME": str(tmp_path), "SCPDR_DECODE_PRECISION": "fp32"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stderr.count("decoding precision: fp32") == 1, out.stderr
