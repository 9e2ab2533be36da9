"""CPU kernels in C that adapt to the instruction set and prove themselves against torch.

- ``scp_delta_r.c`` (:mod:`scpdr.kernels.scp`): the fused SCP-Δr rule that
  :func:`scpdr.naf.scp_delta_r` uses on CPU.
- ``cp_fuse.c`` (:mod:`scpdr.kernels.cp_fuse`): CP-Fuse's grid statistics from two
  exponentials per token, for :func:`scpdr.naf.cp_fuse_step`.
- ``packed_gemm.c`` (:mod:`scpdr.kernels.gemm`): float32 matmuls of a few rows on packed
  weights for the shared-base LoRA fast path (:mod:`scpdr.lora.layers`), with a register tile
  per ISA chosen at build time from the compiler's macros (AVX-512, AVX2 + FMA, aarch64 NEON;
  anything else uses torch).

:mod:`scpdr.kernels.build` compiles them on first use into ``$SCPDR_HOME/kernels`` (for the
``native`` target by default, or any ``-march``: :func:`using_target`), and before a kernel
serves a shape class it is timed against the torch implementation in the same moment and used
only where it is faster (:func:`choose`, logged once at INFO, remembered beside the library).
``SCPDR_NAF_KERNEL`` / ``SCPDR_GEMM_KERNEL`` = ``0`` or ``1`` (or :func:`force`) pick a side
without measuring; :func:`reset` forgets this process's libraries and decisions.
"""

from scpdr.kernels import build, cp_fuse, gemm, scp
from scpdr.kernels.build import (
    ENV_TARGET,
    SWITCHES,
    Choice,
    Library,
    choose,
    decisions,
    default_target,
    force,
    interleaved_medians,
    load,
    policy,
    reset,
    using_target,
)

__all__ = [
    "ENV_TARGET",
    "SWITCHES",
    "Choice",
    "Library",
    "build",
    "choose",
    "cp_fuse",
    "decisions",
    "default_target",
    "force",
    "gemm",
    "interleaved_medians",
    "load",
    "policy",
    "reset",
    "scp",
    "using_target",
]
