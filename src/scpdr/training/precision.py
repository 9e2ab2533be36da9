"""Training precision: fp32, or bf16 autocast with fp32 master weights where that is faster.

``TrainConfig.precision`` (``scpdr train --precision auto|fp32|bf16``):

- ``fp32``: every operation in float32.
- ``bf16``: mixed precision, as the Trainer's ``bf16=True`` does it (on CPU too): the forward and
  the loss run under ``torch.autocast(dtype=torch.bfloat16)`` (matmuls in bf16, reductions and
  the cross-entropy in fp32), while the weights, their gradients and the optimizer state stay
  fp32 (the master weights). The saved model is fp32.
- ``auto`` (the default): bf16 where the hardware has bf16 units *and* it is measured faster,
  else fp32. On CUDA: bf16 when ``torch.cuda.is_bf16_supported()``. On CPU: only where
  ``/proc/cpuinfo`` reports ``amx_bf16`` or ``avx512_bf16`` (elsewhere bf16 is emulated and
  slower), and then only if a micro-benchmark at first use confirms it
  (:func:`micro_benchmark`: a matmul of the 135M model's MLP shape and one small
  forward/backward step, both precisions interleaved, medians) — by at least
  :data:`MIN_SPEEDUP` in every case. The measurement is stored in
  ``$SCPDR_HOME/kernels/precision.choices.json`` keyed by :func:`decision_key` (the CPU's model
  name, torch's version, its thread count and CPU capability), with the kernels'
  measure-then-choose machinery (:func:`scpdr.kernels.build.measured_choice`, STYLE.md 16), so
  later runs skip it; delete the file to measure again. ``$SCPDR_PRECISION`` (``fp32`` or
  ``bf16``) replaces what ``auto`` resolves to, without measuring; an explicit ``fp32`` or
  ``bf16`` wins over it.

:func:`decide_precision` is the decision as a pure function of what was read and measured;
:func:`resolve_precision` reads the flags, measures (or recalls) and calls it. The plan that
``scpdr train`` prints says which precision and why (:attr:`PrecisionChoice.summary`:
``bf16: avx512_bf16 and 1.9x faster in the micro-benchmark``, ``fp32: no bf16 units``).
Only training is affected: the certificate math stays in fp32/float64.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scpdr.errors import ConfigError

__all__ = [
    "BF16_FLAGS",
    "MIN_SPEEDUP",
    "PrecisionChoice",
    "bf16_units",
    "cpu_flags",
    "cpu_model_name",
    "decide_precision",
    "decision_key",
    "env_precision",
    "micro_benchmark",
    "resolve_precision",
]

logger = logging.getLogger(__name__)

#: CPU flags (``/proc/cpuinfo``) of native bf16 arithmetic: Intel AMX and AVX512-BF16 (Intel
#: Cooper Lake and later, AMD Zen 4 and later).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: ``auto`` takes bf16 only when it is at least this much faster in every benchmark case: bf16
#: rounds the activations, worth it for a clear gain, not for noise.
MIN_SPEEDUP = 1.2
#: The micro-benchmark's shapes: tokens x hidden x MLP width (SmolLM2-135M's 576 and 1536).
BENCH_SHAPE = (256, 576, 1536)
_CHOICES_FILE = "precision.choices.json"
#: Environment variable that sets what ``auto`` resolves to (``auto``, ``fp32``, ``bf16``).
ENV = "SCPDR_PRECISION"

Timings = Sequence[tuple[str, float, float]]  # (what, bf16 seconds, fp32 seconds)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run trains in (``"fp32"`` or ``"bf16"``), what was asked for, and why."""

    precision: str
    requested: str
    reason: str

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def summary(self) -> str:
        """``bf16: avx512_bf16 and 1.9x faster in the micro-benchmark``."""
        return f"{self.precision}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the first ``flags``/``Features`` line of ``/proc/cpuinfo``;
    empty where there is none, e.g. macOS)."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def bf16_units(flags: Iterable[str]) -> tuple[str, ...]:
    """The bf16 flags among ``flags`` (:data:`BF16_FLAGS`, in that order)."""
    have = set(flags)
    return tuple(f for f in BF16_FLAGS if f in have)


def _check(requested: str) -> str:
    value = getattr(requested, "value", requested)  # the config's Precision enum or a string
    if value not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision must be auto, fp32 or bf16, got {requested!r}")
    return str(value)


def decide_precision(
    requested: str,
    *,
    device_type: str = "cpu",
    units: Sequence[str] = (),
    timings: Timings | None = None,
    cuda_bf16: bool = False,
    min_speedup: float = MIN_SPEEDUP,
) -> PrecisionChoice:
    """The precision to train (or decode) in, from what was read and measured (no I/O).

    Args:
        requested: ``auto``, ``fp32`` or ``bf16`` (an explicit one is kept).
        device_type: ``cpu`` or ``cuda``.
        units: the CPU's bf16 flags (:func:`bf16_units`).
        timings: ``(what, bf16 seconds, fp32 seconds)`` per micro-benchmark case; ``None``
            when nothing was measured.
        cuda_bf16: whether the GPU supports bf16.
        min_speedup: ``auto`` takes bf16 from this speedup in every case (training:
            :data:`MIN_SPEEDUP`; decoding: :data:`scpdr.serve.precision.MIN_SPEEDUP`).
    """
    requested = _check(requested)
    if requested == "fp32":
        return PrecisionChoice("fp32", requested, "asked for (--precision fp32)")
    if requested == "bf16":
        why = "asked for (--precision bf16)"
        if device_type == "cpu" and not units:
            why += "; this CPU has no bf16 units, so bf16 is emulated and likely slower"
        return PrecisionChoice("bf16", requested, why)
    if device_type == "cuda":
        if cuda_bf16:
            return PrecisionChoice("bf16", requested, "the GPU supports bf16")
        return PrecisionChoice("fp32", requested, "the GPU has no bf16")
    if not units:
        return PrecisionChoice(
            "fp32",
            requested,
            f"no bf16 units (neither {' nor '.join(BF16_FLAGS)} in the CPU flags)",
        )
    have = ", ".join(units)
    speedups = [f / b for _, b, f in timings or () if b > 0]
    if not speedups:
        return PrecisionChoice("fp32", requested, f"{have}, but bf16 could not be measured")
    slowest = min(speedups)
    if slowest >= min_speedup:
        return PrecisionChoice(
            "bf16", requested, f"{have} and {slowest:.2g}x faster in the micro-benchmark"
        )
    return PrecisionChoice(
        "fp32",
        requested,
        f"{have}, but bf16 only {slowest:.3g}x fp32 in the micro-benchmark "
        f"(auto takes it from {min_speedup:g}x)",
    )


def micro_benchmark(*, repeats: int = 5, shape: tuple[int, int, int] = BENCH_SHAPE) -> Timings:
    """``(what, bf16 seconds, fp32 seconds)`` on this CPU, medians of ``repeats`` interleaved
    rounds: a ``tokens x hidden @ hidden x width`` matmul, and one forward + backward of a
    two-layer MLP block (the matmuls of a training step), bf16 under ``torch.autocast``."""
    import torch

    from scpdr.kernels.build import interleaved_medians

    n, h, w = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g)
    w1 = (torch.randn(h, w, generator=g) / h**0.5).requires_grad_()
    w2 = (torch.randn(w, h, generator=g) / w**0.5).requires_grad_()
    a16, b16 = x.bfloat16(), w1.detach().bfloat16()

    def matmul_bf16() -> None:
        torch.mm(a16, b16)

    def matmul_fp32() -> None:
        torch.mm(x, w1.detach())

    def step(bf16: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = torch.nn.functional.silu(x @ w1) @ w2
                loss = y.float().pow(2).mean()
            loss.backward()
            w1.grad = w2.grad = None

        return run

    t = interleaved_medians(
        {
            "mm16": matmul_bf16,
            "mm32": matmul_fp32,
            "step16": step(True),
            "step32": step(False),
        },
        repeats=repeats,
    )
    return [
        (f"matmul {n}x{h}x{w}", t["mm16"], t["mm32"]),
        (f"forward+backward {n}x{h}x{w}", t["step16"], t["step32"]),
    ]


def _cache_file() -> Path:
    from scpdr.kernels.build import cache_dir

    return cache_dir() / _CHOICES_FILE


def env_precision(env: str = ENV) -> str | None:
    """``$SCPDR_PRECISION`` (:data:`ENV`, or the variable ``env``): ``fp32`` or ``bf16``
    replace ``auto``'s decision; unset, empty or ``auto``: ``None``."""
    value = os.environ.get(env, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("fp32", "bf16"):
        raise ConfigError(f"{env} must be auto, fp32 or bf16, got {value!r}")
    return value


def decision_key(model: str) -> str:
    """What a stored measurement is valid for: the CPU model, torch's version, its thread count
    and the CPU capability its kernels were dispatched for (``torch.backends.cpu``)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return f"{model}|torch {torch.__version__}|threads {torch.get_num_threads()}|{capability}"


def resolve_precision(
    requested: str,
    *,
    device: str = "cpu",
    flags: Iterable[str] | None = None,
    measure: Callable[[], Timings] | None = None,
    purpose: str = "training",
    min_speedup: float = MIN_SPEEDUP,
    env: str = ENV,
) -> PrecisionChoice:
    """The precision a run on ``device`` trains in (:func:`decide_precision`).

    ``auto`` is ``$SCPDR_PRECISION`` where that is ``fp32`` or ``bf16`` (an explicit
    ``fp32``/``bf16`` request wins over it); otherwise, on a CPU with bf16 units, it measures
    once per :func:`decision_key` (``measure``, default :func:`micro_benchmark`; stored in
    ``$SCPDR_HOME/kernels/precision.choices.json``: delete it to measure again); ``flags``
    replaces the CPU's own (``/proc/cpuinfo``). ``purpose`` other than ``training`` (the
    decoding precision, :func:`scpdr.serve.precision.resolve_decode_precision`) is a separate
    decision, stored under ``"<purpose>|"`` + the key, with its own ``measure``,
    ``min_speedup`` and environment variable ``env``."""
    requested = _check(requested)
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    forced = env_precision(env) if requested == "auto" else None
    if forced is not None:
        units = bf16_units(cpu_flags() if flags is None else flags)
        chosen = decide_precision(forced, device_type=device_type, units=units)
        _, sep, rest = chosen.reason.partition(";")  # bf16 without units: says it is emulated
        return PrecisionChoice(forced, requested, f"{env}={forced}{sep}{rest}")
    if requested != "auto":
        units = bf16_units(cpu_flags() if flags is None else flags)
        return decide_precision(requested, device_type=device_type, units=units)
    if device_type == "cuda":
        import torch

        return decide_precision(
            requested, device_type="cuda", cuda_bf16=bool(torch.cuda.is_bf16_supported())
        )
    if measure is None and purpose != "training":
        raise ValueError(f"the {purpose} precision needs its own micro-benchmark (measure=)")
    units = bf16_units(cpu_flags() if flags is None else flags)
    if not units:
        return decide_precision(requested, device_type="cpu", units=units)
    from scpdr.kernels.build import measured_choice

    model = cpu_model_name()
    key = decision_key(model) if purpose == "training" else f"{purpose}|{decision_key(model)}"
    choice = measured_choice(
        _cache_file(),
        key,
        measure or micro_benchmark,
        describe=lambda c: (
            f"{purpose} precision on {model} ({', '.join(units)}): "
            + ", ".join(f"bf16 {f / b:.2g}x fp32 {what}" for what, b, f in c.timings if b > 0)
            + (": bf16 used" if c.use_kernel else ": fp32 used")
        ),
        min_speedup=min_speedup,
        reason="bf16 against fp32",
    )
    return decide_precision(
        requested, device_type="cpu", units=units, timings=choice.timings, min_speedup=min_speedup
    )
