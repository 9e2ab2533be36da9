"""Training precision (scpdr.training.precision): the decision from the CPU's flags and the
micro-benchmark's timings (injected), measured once per CPU model and torch version and then
read back, fp32 where the CPU has no bf16 units, an explicit bf16 run that trains with finite
losses in bf16 arithmetic, and configs written with the former `bf16` field."""

from __future__ import annotations

import json

import pytest
import torch

from scpdr.data import names2ids
from scpdr.errors import ConfigError
from scpdr.training import TRAIN_INFO, TrainConfig, finetune
from scpdr.training.precision import (
    MIN_SPEEDUP,
    bf16_units,
    decide_precision,
    resolve_precision,
)

FLAGS = "fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile".split()


def _timings(speedup: float):
    return [("matmul", 1.0, speedup), ("forward+backward", 2.0, 2.0 * speedup)]


def test_decision_from_flags_and_timings():
    assert bf16_units(FLAGS) == ("avx512_bf16",)
    assert bf16_units([*FLAGS, "amx_bf16"]) == ("amx_bf16", "avx512_bf16")
    assert bf16_units(["avx2", "fma"]) == ()
    # auto: bf16 units and measured faster by at least MIN_SPEEDUP in every case
    c = decide_precision("auto", units=("avx512_bf16",), timings=_timings(1.9))
    assert c.bf16 and c.summary == "bf16: avx512_bf16 and 1.9x faster in the micro-benchmark"
    slow = [("matmul", 1.0, 3.0), ("forward+backward", 1.0, MIN_SPEEDUP * 0.9)]
    c = decide_precision("auto", units=("avx512_bf16",), timings=slow)
    assert not c.bf16 and "only 1.08x" in c.reason  # the slowest case decides
    # just under the threshold reads as under it, not as the threshold itself
    c = decide_precision("auto", units=("amx_bf16",), timings=_timings(1.09), min_speedup=1.1)
    assert not c.bf16 and "only 1.09x fp32" in c.reason and "from 1.1x" in c.reason
    assert not decide_precision("auto", units=("amx_bf16",), timings=[]).bf16
    # no bf16 units: fp32 without measuring
    c = decide_precision("auto", units=(), timings=_timings(5.0))
    assert c.precision == "fp32" and c.summary.startswith("fp32: no bf16 units")
    # explicit choices are kept; bf16 without units says it is emulated
    assert decide_precision("fp32", units=("amx_bf16",), timings=_timings(9)).precision == "fp32"
    c = decide_precision("bf16", units=())
    assert c.bf16 and "emulated" in c.reason
    assert "emulated" not in decide_precision("bf16", units=("amx_bf16",)).reason
    # CUDA: what the GPU supports
    assert decide_precision("auto", device_type="cuda", cuda_bf16=True).bf16
    assert not decide_precision("auto", device_type="cuda", cuda_bf16=False).bf16
    with pytest.raises(ConfigError, match="auto, fp32 or bf16"):
        decide_precision("fp16")


def test_auto_measures_once_per_cpu_model_and_torch_version(tmp_path, monkeypatch):
    from scpdr import kernels

    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.delenv("SCPDR_PRECISION", raising=False)  # the suite's fp32 (conftest)
    kernels.reset()
    calls = []

    def measure():
        calls.append(1)
        return _timings(2.0)

    try:
        first = resolve_precision("auto", flags=FLAGS, measure=measure)
        assert first.bf16 and calls == [1]
        kernels.reset()  # a new process: the decision is read back from SCPDR_HOME

        def never():
            raise AssertionError("measured again")

        again = resolve_precision("auto", flags=FLAGS, measure=never)
        assert again == first
        [stored] = (tmp_path / "kernels").glob("precision*.json")
        [key] = json.loads(stored.read_text())
        # per CPU model, torch version, thread count and the CPU capability torch dispatches to
        assert key.endswith(
            f"|torch {torch.__version__}|threads {torch.get_num_threads()}"
            f"|{torch.backends.cpu.get_cpu_capability()}"
        )
        # no bf16 units, or an explicit precision: nothing is measured
        assert resolve_precision("auto", flags=["avx2", "fma"], measure=never).precision == "fp32"
        assert resolve_precision("fp32", flags=FLAGS, measure=never).precision == "fp32"
        assert resolve_precision("bf16", flags=[], measure=never).bf16
    finally:
        kernels.reset()


def test_environment_sets_what_auto_resolves_to(tmp_path, monkeypatch):
    """SCPDR_PRECISION=fp32|bf16 replaces auto's decision (nothing measured); an explicit
    precision wins over it; auto or unset leaves auto to decide; anything else is an error."""
    from scpdr import kernels

    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    kernels.reset()

    def never():
        raise AssertionError("measured")

    try:
        monkeypatch.setenv("SCPDR_PRECISION", "fp32")
        c = resolve_precision("auto", flags=FLAGS, measure=never)
        assert c.precision == "fp32" and c.requested == "auto"
        assert c.reason == "SCPDR_PRECISION=fp32"
        assert resolve_precision("bf16", flags=FLAGS, measure=never).bf16  # explicit wins
        monkeypatch.setenv("SCPDR_PRECISION", "bf16")
        c = resolve_precision("auto", flags=[], measure=never)
        assert c.bf16 and "emulated" in c.reason
        assert resolve_precision("fp32", flags=FLAGS, measure=never).precision == "fp32"
        assert resolve_precision("auto", device="cuda", measure=never).bf16
        monkeypatch.setenv("SCPDR_PRECISION", "auto")
        assert resolve_precision("auto", flags=FLAGS, measure=lambda: _timings(2.0)).bf16
        monkeypatch.setenv("SCPDR_PRECISION", "fp16")
        with pytest.raises(ConfigError, match="SCPDR_PRECISION"):
            resolve_precision("auto", flags=FLAGS, measure=never)
    finally:
        kernels.reset()


def test_old_bf16_field_loads_as_precision():
    assert TrainConfig.from_dict({"bf16": True}).precision == "bf16"
    assert TrainConfig.from_dict({"bf16": False}).precision == "fp32"  # what those runs used
    assert TrainConfig.from_json('{"bf16": true, "precision": "bf16"}').precision == "bf16"
    with pytest.raises(ConfigError, match="contradicts"):
        TrainConfig.from_dict({"bf16": True, "precision": "fp32"})
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig.from_dict({"precision": "fp16"})
    # a run trained with bf16: true keeps its fingerprint; auto and fp32 are the former false
    assert (
        TrainConfig(precision="bf16").fingerprint()
        == TrainConfig.from_dict({"bf16": True}).fingerprint()
    )
    assert TrainConfig(precision="fp32").fingerprint() == TrainConfig().fingerprint()
    assert TrainConfig(precision="bf16").fingerprint() != TrainConfig().fingerprint()
    cfg = TrainConfig(precision="bf16", group_by_length=False, chunked_loss=False)
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg
    assert TrainConfig(group_by_length=False).fingerprint() != TrainConfig().fingerprint()
    assert TrainConfig(chunked_loss=False).fingerprint() == TrainConfig().fingerprint()


def test_explicit_bf16_trains_with_finite_losses_in_bf16(tmp_path):
    from safetensors.torch import load_file

    from scpdr.testing import tiny_model, tiny_tokenizer

    records = names2ids(n_train=12, n_val=1, seed=0).train
    base = (tiny_model(0), tiny_tokenizer())
    common = dict(
        max_steps=3,
        batch_size=4,
        seq_len=64,
        learning_rate=1e-2,
        warmup_steps=0,
        progress=False,
        logging_steps=1,
    )
    runs = {}
    for precision in ("bf16", "fp32"):
        cfg = TrainConfig(precision=precision, **common)
        out = finetune(records, base=base, config=cfg, out=tmp_path / precision)
        info = json.loads((out / TRAIN_INFO).read_text())
        assert info["precision"]["precision"] == precision
        assert info["precision"]["requested"] == precision
        losses = [h["loss"] for h in info["log_history"] if "loss" in h]
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
        runs[precision] = (losses, load_file(str(out / "model.safetensors")))
    (l16, w16), (l32, w32) = runs["bf16"], runs["fp32"]
    assert all(w.dtype == torch.float32 for w in w16.values())  # fp32 master weights, saved
    # bf16 arithmetic: not the fp32 numbers, but close to them
    assert l16 != l32 and abs(l16[0] - l32[0]) < 0.05 * abs(l32[0])
    assert any(not torch.equal(w16[k], w32[k]) for k in w32)


def test_other_processes_take_the_main_process_precision(monkeypatch):
    """Under a launcher only the main process resolves (measures) the precision; the others
    receive its PrecisionChoice (accelerate's broadcast_object_list) and compute nothing."""
    import accelerate.utils

    from scpdr.training import placement
    from scpdr.training.precision import PrecisionChoice

    mains = PrecisionChoice("bf16", "auto", "measured by rank 0")
    sent = []

    def broadcast(box, from_process=0):
        sent.append(list(box))
        box[0] = mains  # what rank 0 put in
        return box

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    monkeypatch.setattr(placement, "launched", lambda: True)

    def never():
        raise AssertionError("a non-main process resolved the precision itself")

    monkeypatch.setattr(placement, "is_main_process", lambda: False)
    assert placement.main_result(never) == mains and sent == [[None]]
    monkeypatch.setattr(placement, "is_main_process", lambda: True)
    assert placement.main_result(lambda: mains) == mains and sent[-1] == [mains]


def test_print_plans_resolves_the_training_device(tmp_path, monkeypatch):
    """`scpdr train`'s plan resolves the precision for the device training will use
    (training_device), not for the string "None"."""
    from types import SimpleNamespace

    from scpdr.commands.train import print_plans
    from scpdr.testing import tiny_tokenizer
    from scpdr.training import placement, precision
    from scpdr.training.precision import PrecisionChoice

    tiny_tokenizer().save_pretrained(str(tmp_path))
    seen = []
    monkeypatch.setattr(placement, "training_device", lambda d: "cuda" if d is None else d)

    def resolve(requested, *, device="cpu", **kw):
        seen.append(device)
        return PrecisionChoice("bf16", str(requested), f"on {device}")

    monkeypatch.setattr(precision, "resolve_precision", resolve)
    records = names2ids(n_train=6, n_val=1, seed=0).train
    pset = SimpleNamespace(k=2, parts=[records[:3], records[3:]])
    print_plans(pset, str(tmp_path), TrainConfig(), None)
    assert seen == ["cuda"]


def test_resume_differences_compare_configs_as_trainconfig_reads_them(tmp_path):
    """The refusal to resume another run names real differences only: a run.json from before
    `precision` (bf16: false, no precision, grouping or chunked loss) against today's fp32 run
    differs in nothing; the precision compared is the one each trained in."""
    from scpdr.training.resume import _differences

    now = TrainConfig().resolved().model_dump(mode="json")
    old = {k: v for k, v in now.items() if k not in ("precision", "group_by_length")}
    old = {**{k: v for k, v in old.items() if k != "chunked_loss"}, "bf16": False}
    base = {"records_sha256": "x", "records": 3, "base": "b", "optim": "adamw_torch"}
    (tmp_path / "run.json").write_text(json.dumps({**base, "config": old}))
    run = {**base, "config": now, "precision": "fp32"}
    assert _differences(tmp_path, run) == "nothing its run.json records"
    said = _differences(tmp_path, {**run, "precision": "bf16"})
    assert "bf16" not in said.replace("'bf16' now", "") and "precision ('fp32' then" in said
    changed = {**run, "config": {**now, "learning_rate": 1.0}}
    assert _differences(tmp_path, changed).startswith("learning_rate (interrupted run: 5e-05")


def test_measured_choice_and_decision_agree_at_the_threshold(tmp_path):
    """A speedup of exactly MIN_SPEEDUP is "at least" it for both the stored choice
    (measured_choice) and the precision decision."""
    from scpdr import kernels
    from scpdr.kernels.build import measured_choice

    at = [("matmul", 1.0, MIN_SPEEDUP), ("forward+backward", 2.0, 2.0 * MIN_SPEEDUP)]
    kernels.reset()
    try:
        choice = measured_choice(
            tmp_path / "c.json", "k", lambda: at, describe=str, min_speedup=MIN_SPEEDUP
        )
    finally:
        kernels.reset()
    assert choice.use_kernel
    assert decide_precision("auto", units=("amx_bf16",), timings=at).bf16
