"""The fused CPU kernel of SCP-Δr (``resources/scp_delta_r.c``), built once with the system C
compiler and loaded with :mod:`ctypes`.

Why: on CPU the torch implementation of SCP-Δr (:func:`scpdr.naf._scp_delta_r`) makes ~65 small
ATen calls and writes ~9 MB of intermediates at batch 8, so right after a decode step it costs
1.5–3% of the step (``docs/performance.md``). The kernel does one row at a time in a few
vectorized passes over data that stays in the L2 cache and writes only the output: ~0.5% (B = 1)
and ~1.7% (B = 8) of a decode step of the embedded model.

Built on first use with ``$CC`` (default ``cc``) ``-O3 -march=native`` into
``$SCPDR_HOME/kernels/`` under a name that hashes the source, the flags and the CPU's flags (a
cache shared between machines never loads a library built for another CPU), written atomically.
When there is no compiler, the build fails, or ``SCPDR_NAF_KERNEL=0``, :func:`scp_delta_r_kernel`
returns None (logged once) and :mod:`scpdr.naf` uses the torch implementation; the two agree to
~1e-5 (tested).
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
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["MAX_K", "MAX_M", "kernel_disabled", "scp_delta_r_kernel"]

#: Limits of the kernel (larger K or m use the torch implementation).
MAX_K = 16
MAX_M = 64
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math")
_SOURCE = "scp_delta_r.c"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def kernel_disabled() -> bool:
    """``SCPDR_NAF_KERNEL=0`` (or ``false``/``no``/``off``) turns the kernel off."""
    return os.environ.get("SCPDR_NAF_KERNEL", "1").strip().lower() in {"0", "false", "no", "off"}


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


def _build(source: bytes, compiler: str) -> Path:
    key = hashlib.sha256(source + repr((_FLAGS, compiler, _cpu_signature())).encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / "kernels" / f"scp_delta_r-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / _SOURCE
        src.write_bytes(source)
        out = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, "-shared", "-fPIC", "-o", str(out), str(src), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: a concurrent build writes the same bytes
    return target


def scp_delta_r_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C function ``scp_delta_r_f32(x, K, N, V, base, base_rows, m, out) -> int``, or None
    when it is disabled or cannot be built here (the reason is logged once)."""
    if kernel_disabled():
        return None
    with _LOCK:
        if "fn" in _STATE:
            return _STATE["fn"]  # type: ignore[return-value]
        fn = None
        try:
            compiler = os.environ.get("CC") or "cc"
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC)")
            source = resources.files("scpdr").joinpath("resources", _SOURCE).read_bytes()
            lib = ctypes.CDLL(str(_build(source, compiler)))
            fn = lib.scp_delta_r_f32
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p,  # x (K, N, V) float32, contiguous
                ctypes.c_int64,  # K
                ctypes.c_int64,  # N
                ctypes.c_int64,  # V
                ctypes.c_void_p,  # base (base_rows, V) float32, contiguous
                ctypes.c_int64,  # base_rows: 1 (a constant base) or N
                ctypes.c_int64,  # m
                ctypes.c_void_p,  # out (N, V) float32
            ]
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning(
                "SCP-Δr: the fused CPU kernel is not available (%s); using the torch "
                "implementation (slower, same results)",
                exc,
            )
            fn = None
        _STATE["fn"] = fn
        return fn
