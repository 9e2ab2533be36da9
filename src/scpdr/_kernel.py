"""CPU kernels written in C (``resources/*.c``), built once with the system C compiler and loaded
with :mod:`ctypes`:

- ``scp_delta_r.c``: the fused SCP-Δr rule. On CPU the torch implementation
  (:func:`scpdr.naf._scp_delta_r`) makes ~65 small ATen calls and writes ~9 MB of intermediates
  at batch 8, so right after a decode step it costs 1.5–3% of the step
  (``docs/performance.md``). The kernel does one row at a time in a few vectorized passes over
  data that stays in the L2 cache and writes only the output: ~0.5% (B = 1) and ~1.7% (B = 8) of
  a decode step of the embedded model. Switch: ``SCPDR_NAF_KERNEL=0``.
- ``packed_gemm.c``: float32 matmuls of a few rows on a packed weight layout, for the shared-base
  LoRA fast path (:mod:`scpdr.lora_fast`, ``docs/lora_fast_path.md``): 2.2x (1 row) to 2x (24
  rows) faster than torch's sgemm on the embedded model's weights, one thread. Built with
  ``-fopenmp`` where available, on torch's own OpenMP runtime (its ``libgomp.so.1``), so it
  splits the work over ``torch.get_num_threads()`` threads. Switch: ``SCPDR_GEMM_KERNEL=0``.

Each is built on first use with ``$CC`` (default ``cc``) ``-O3 -march=native`` into
``$SCPDR_HOME/kernels/`` under a name that hashes the source, the flags and the CPU's flags (a
cache shared between machines never loads a library built for another CPU), written atomically.
When there is no compiler, the build fails, or the switch is ``0``, the loader returns None
(logged once) and the caller uses its torch implementation; the two agree to float rounding
(tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_K",
    "MAX_M",
    "gemm_disabled",
    "kernel_disabled",
    "packed_gemm_kernel",
    "scp_delta_r_kernel",
]

#: Limits of the kernel (larger K or m use the torch implementation).
MAX_K = 16
MAX_M = 64
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_UNSET = object()


def _switched_off(var: str) -> bool:
    return os.environ.get(var, "1").strip().lower() in {"0", "false", "no", "off"}


def kernel_disabled() -> bool:
    """``SCPDR_NAF_KERNEL=0`` (or ``false``/``no``/``off``) turns the SCP-Δr kernel off."""
    return _switched_off("SCPDR_NAF_KERNEL")


def gemm_disabled() -> bool:
    """``SCPDR_GEMM_KERNEL=0`` (or ``false``/``no``/``off``) turns the packed GEMM kernel off."""
    return _switched_off("SCPDR_GEMM_KERNEL")


def _cache_dir() -> Path:
    home = os.environ.get("SCPDR_HOME")
    return Path(home) if home else Path.home() / ".cache" / "scpdr"


def _cpu_signature() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{flags}"


def _build(name: str, source: bytes, compiler: str, extra: tuple[str, ...] = ()) -> Path:
    flags = (*_FLAGS, *extra)
    key = hashlib.sha256(source + repr((flags, compiler, _cpu_signature())).encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / "kernels" / f"{name}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_bytes(source)
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(src), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: a concurrent build writes the same bytes
    return target


def _load(name: str, source: bytes, compiler: str, openmp: bool) -> ctypes.CDLL:
    """Build (cached) and load; with ``openmp``, first with ``-fopenmp`` (the library then needs
    ``libgomp.so.1``: torch is imported first so that this resolves to the runtime torch already
    loaded, one thread pool for both), else or when that fails, without (single-threaded)."""
    if openmp:
        import torch  # noqa: F401  (loads torch's libgomp.so.1 before ours asks for it)

        try:
            return ctypes.CDLL(str(_build(name, source, compiler, ("-fopenmp",))))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.info("%s: no OpenMP build (%s); building it single-threaded", name, exc)
    return ctypes.CDLL(str(_build(name, source, compiler)))


def _library(
    name: str,
    what: str,
    fallback: str,
    configure: Callable[[ctypes.CDLL], None],
    *,
    openmp: bool = False,
) -> ctypes.CDLL | None:
    """``resources/<name>.c`` built, loaded and ``configure``-d (argument types; once per
    process), or None with a warning (once) naming ``what`` failed and the ``fallback`` used
    instead. ``openmp``: see :func:`_load`."""
    lib = _STATE.get(name, _UNSET)  # the common case, called per layer and step: no lock
    if lib is not _UNSET:
        return lib  # type: ignore[return-value]
    with _LOCK:
        if name in _STATE:
            return _STATE[name]  # type: ignore[return-value]
        lib = None
        try:
            compiler = os.environ.get("CC") or "cc"
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC)")
            source = resources.files("scpdr").joinpath("resources", f"{name}.c").read_bytes()
            lib = _load(name, source, compiler, openmp)
            configure(lib)
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            logger.warning("%s is not available (%s); using %s", what, exc, fallback)
            lib = None
        _STATE[name] = lib
        return lib


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _configure_scp_delta_r(lib: ctypes.CDLL) -> None:
    fn = lib.scp_delta_r_f32
    fn.restype = ctypes.c_int
    # x (K, N, V), K, N, V, base (base_rows, V), base_rows (1: a constant base, or N), m,
    # out (N, V); float32, contiguous
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR]


def _configure_packed_gemm(lib: ctypes.CDLL) -> None:
    gemm = lib.scpdr_gemm_packed_f32
    # m, n, k, x, ldx, packed w, y, ldy, accumulate, threads
    gemm.argtypes = [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, ctypes.c_int, _I64]
    gemm.restype = None
    lora = lib.scpdr_lora_linear_f32
    # g, rows, n, k, x, packed w, l, r, packed a, packed b, tmp, y, threads
    lora.argtypes = [_I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64]
    lora.restype = None


def scp_delta_r_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C function ``scp_delta_r_f32(x, K, N, V, base, base_rows, m, out) -> int``, or None
    when it is disabled or cannot be built here (the reason is logged once)."""
    if kernel_disabled():
        return None
    lib = _library(
        "scp_delta_r",
        "SCP-Δr: the fused CPU kernel",
        "the torch implementation (slower, same results)",
        _configure_scp_delta_r,
    )
    return None if lib is None else lib.scp_delta_r_f32


def packed_gemm_kernel() -> ctypes.CDLL | None:
    """The library of ``packed_gemm.c`` (``scpdr_gemm_packed_f32``, ``scpdr_lora_linear_f32``),
    or None when it is disabled or cannot be built here (the reason is logged once)."""
    if gemm_disabled():
        return None
    return _library(
        "packed_gemm",
        "LoRA fast path: the packed CPU matmul kernel",
        "torch matmuls (slower, same results)",
        _configure_packed_gemm,
        openmp=True,
    )
