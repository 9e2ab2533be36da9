"""Compile, cache, measure against torch and choose: the machinery behind :mod:`scpdr.kernels`.

Each C source of this package is built on first use with ``$CC`` (default ``cc``) ``-O3
-march=<target>`` into ``$SCPDR_HOME/kernels/`` under a name that hashes the source, the flags,
the compiler and the CPU's flags (a cache shared between machines never loads a library built
for another CPU), written atomically, and loaded with :mod:`ctypes`. The *target* is
``native`` (the default; ``SCPDR_KERNEL_TARGET`` changes it) or any other ``-march`` value,
e.g. ``x86-64-v3`` (AVX2 + FMA: what most x86 users have), which the benchmarks build beside
the native one to time both instruction sets on one machine.

A kernel is only a candidate: before it serves a shape class the first time, the caller times
it against its torch implementation on that shape, both in the same moment (interleaved
rounds, medians: robust to other load on the machine), and keeps the faster one
(:func:`choose`; STYLE.md 16, after torch's cuDNN benchmark mode). The decision is logged
once at INFO (``packed GEMM (avx512, native build): 2.1× torch at 3 rows, 1.9× torch at 24
rows: kernel used``) and stored beside the library (``<library>.choices.json``), so later
processes skip the measurement. :func:`measured_choice` is that mechanism for any candidate
against its reference (training's bf16 against fp32 uses it too: ``scpdr.training.precision``). Environment switches force either side without measuring:
``SCPDR_NAF_KERNEL`` (the SCP-Δr and CP-Fuse kernels) and ``SCPDR_GEMM_KERNEL`` (the packed GEMM) set to
``0``/``off``/``false``/``no`` use torch, ``1``/``on``/``true``/``yes`` the kernel, ``auto``
(or unset) measure. :func:`force` does the same from code and :func:`reset` forgets this
process's libraries and decisions (tests).

When there is no compiler or the build fails, :func:`load` returns None (a warning, once) and
callers use torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from scpdr.io import atomic_write_json

logger = logging.getLogger("scpdr.kernels")

__all__ = [
    "ENV_TARGET",
    "SWITCHES",
    "Choice",
    "Library",
    "Side",
    "choices_file",
    "choose",
    "decisions",
    "default_target",
    "force",
    "interleaved_medians",
    "kernel_source",
    "load",
    "measured_choice",
    "policy",
    "remembered",
    "reset",
    "using_target",
]

Side = Literal["auto", "kernel", "torch"]
#: Environment variable naming the default build target (a ``-march`` value; "native").
ENV_TARGET = "SCPDR_KERNEL_TARGET"
#: Environment switch of each kernel (``0`` torch, ``1`` kernel, ``auto``/unset: measure).
SWITCHES = {
    "scp_delta_r": "SCPDR_NAF_KERNEL",
    "cp_fuse": "SCPDR_NAF_KERNEL",
    "packed_gemm": "SCPDR_GEMM_KERNEL",
}
_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math")
_OFF = {"0", "false", "no", "off"}
_ON = {"1", "true", "yes", "on"}
_TARGET_RE = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


class _State:
    """This process's libraries, decisions and overrides (one lock for all)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.libraries: dict[tuple[str, str], Library | None] = {}
        self.choices: dict[tuple[str, str], Choice] = {}
        self.forced: dict[str, Side] = {}
        self.target: str | None = None


_STATE = _State()


@dataclass(frozen=True)
class Library:
    """A built and loaded kernel library.

    ``name``: the C source (``scp_delta_r``, ``packed_gemm``); ``target``: its ``-march``;
    ``isa``: the instruction set its code was specialized for, as the library reports it
    (``avx512``, ``avx2``, ``neon``, ``generic``); ``openmp``: built with ``-fopenmp``.
    """

    name: str
    target: str
    path: Path
    cdll: ctypes.CDLL
    isa: str
    openmp: bool

    @property
    def label(self) -> str:
        """``"avx512, native build"``: for logs and benchmark reports."""
        return f"{self.isa}, {self.target} build"

    @functools.cached_property
    def choices_path(self) -> Path:
        """Where its measured decisions are stored (``<library>.choices.json``), computed once:
        the per-step lookups of a decision do no path arithmetic."""
        return self.path.with_suffix(".choices.json")


@dataclass(frozen=True)
class Choice:
    """Kernel or torch for one shape class, and why.

    ``timings``: ``(what, kernel seconds, torch seconds)`` per measured case (empty when forced
    or when the library reports an instruction set without a tile).
    """

    use_kernel: bool
    reason: str
    timings: tuple[tuple[str, float, float], ...] = ()

    @property
    def speedups(self) -> dict[str, float]:
        """``{what: torch time / kernel time}`` (> 1: the kernel is faster)."""
        return {what: t / k for what, k, t in self.timings if k > 0}


def default_target() -> str:
    """The build target used when none is given: :func:`using_target`'s, else
    ``$SCPDR_KERNEL_TARGET``, else ``native``."""
    with _STATE.lock:
        if _STATE.target is not None:
            return _STATE.target
    return os.environ.get(ENV_TARGET, "").strip() or "native"


@contextlib.contextmanager
def using_target(target: str) -> Iterator[None]:
    """Within the block, kernels load (and layers pack for) the ``target`` build, e.g.
    ``x86-64-v3`` to time the AVX2 code on an AVX-512 machine (process-wide, not per thread)."""
    _check_target(target)
    with _STATE.lock:
        old, _STATE.target = _STATE.target, target
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.target = old


def _check_target(target: str) -> str:
    if not _TARGET_RE.match(target):
        raise ValueError(f"kernel target must be a -march value such as 'native', got {target!r}")
    return target


def policy(name: str) -> Side:
    """How the kernel ``name`` is chosen now: :func:`force`'s side, else its environment switch
    (:data:`SWITCHES`), else ``auto`` (measure)."""
    with _STATE.lock:
        if name in _STATE.forced:
            return _STATE.forced[name]
    value = os.environ.get(SWITCHES.get(name, ""), "").strip().lower()
    if value in _OFF:
        return "torch"
    if value in _ON:
        return "kernel"
    return "auto"


@contextlib.contextmanager
def force(name: str, side: Side) -> Iterator[None]:
    """Within the block, kernel ``name`` (``scp_delta_r``, ``packed_gemm``) is used
    (``"kernel"``, where it builds), not used (``"torch"``) or measured (``"auto"``),
    whatever the environment says. Layers packed inside the block stay packed after it."""
    if name not in SWITCHES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(SWITCHES)}")
    if side not in ("auto", "kernel", "torch"):
        raise ValueError(f"side must be 'auto', 'kernel' or 'torch', got {side!r}")
    with _STATE.lock:
        old = _STATE.forced.get(name)
        _STATE.forced[name] = side
    try:
        yield
    finally:
        with _STATE.lock:
            if old is None:
                _STATE.forced.pop(name, None)
            else:
                _STATE.forced[name] = old


def reset() -> None:
    """Forget this process's loaded libraries and kernel/torch decisions (the next use loads
    and decides again, reading ``$SCPDR_HOME`` afresh); forced sides and targets stay."""
    with _STATE.lock:
        _STATE.libraries.clear()
        _STATE.choices.clear()


# --------------------------------------------------------------------------------------------
# building


def cache_dir() -> Path:
    """``$SCPDR_HOME/kernels`` (default ``~/.cache/scpdr/kernels``)."""
    home = os.environ.get("SCPDR_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "scpdr") / "kernels"


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


_LOCAL_INCLUDE = re.compile(rb'^#include "([A-Za-z0-9_]+\.h)"([^\n]*)$', re.MULTILINE)


def kernel_source(name: str) -> bytes:
    """``<name>.c`` of this package as one self-contained translation unit: each
    ``#include "x.h"`` of a header beside it (e.g. ``fast_math.h``) replaced by the header's
    text, so that the build (from a temporary directory) and its cache key see all of it."""
    pkg = resources.files("scpdr.kernels")

    def inline(match: re.Match[bytes]) -> bytes:
        return pkg.joinpath(match.group(1).decode()).read_bytes().rstrip(b"\n")

    return _LOCAL_INCLUDE.sub(inline, pkg.joinpath(f"{name}.c").read_bytes())


def compile_library(
    name: str, source: bytes, compiler: str, target: str, extra: Sequence[str] = ()
) -> Path:
    """``source`` compiled into ``$SCPDR_HOME/kernels/<name>-<hash>.so`` (cached; written
    atomically: a concurrent build writes the same bytes). Raises RuntimeError with the
    compiler's message when it fails."""
    flags = (*_FLAGS, f"-march={_check_target(target)}", *extra)
    key = hashlib.sha256(source + repr((flags, compiler, _cpu_signature())).encode())
    target_path = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target_path.is_file():
        return target_path
    target_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_path.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_bytes(source)
        out = Path(tmp) / target_path.name
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(src), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target_path)
    return target_path


def _open(name: str, source: bytes, compiler: str, target: str, openmp: bool):
    """``(CDLL, openmp)``: with ``openmp``, first built with ``-fopenmp`` (the library then
    needs ``libgomp.so.1``: torch is imported first so that this resolves to the runtime torch
    already loaded, one thread pool for both), else or when that fails, without."""
    if openmp:
        import torch  # noqa: F401  (loads torch's libgomp.so.1 before ours asks for it)

        try:
            path = compile_library(name, source, compiler, target, ("-fopenmp",))
            return ctypes.CDLL(str(path)), path, True
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.info("%s: no OpenMP build (%s); building it single-threaded", name, exc)
    path = compile_library(name, source, compiler, target)
    return ctypes.CDLL(str(path)), path, False


def load(
    name: str,
    *,
    what: str,
    configure: Callable[[ctypes.CDLL], str],
    target: str | None = None,
    openmp: bool = False,
) -> Library | None:
    """``<name>.c`` of this package built for ``target`` (default :func:`default_target`),
    loaded and ``configure``-d (argument types; returns the ISA the library reports), once per
    process; or None with a warning (once) naming ``what`` failed (no compiler, a failed
    build). ``openmp``: see :func:`_open`."""
    key = (name, target or default_target())
    lib = _STATE.libraries.get(key, _MISSING)  # the common case, per layer and step: no lock
    if lib is not _MISSING:
        return lib  # type: ignore[return-value]
    target = _check_target(key[1])
    with _STATE.lock:
        if key in _STATE.libraries:
            return _STATE.libraries[key]
        lib = None
        try:
            compiler = os.environ.get("CC") or "cc"
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC)")
            source = kernel_source(name)
            cdll, path, omp = _open(name, source, compiler, target, openmp)
            lib = Library(name, target, path, cdll, configure(cdll), omp)
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            logger.warning("%s is not available (%s); using torch", what, exc)
            lib = None
        _STATE.libraries[key] = lib
        return lib


_MISSING = object()


# --------------------------------------------------------------------------------------------
# measuring and choosing


def interleaved_medians(
    fns: dict[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median wall seconds per call of each function, called round-robin (every function sees
    the same machine load); ``warmup`` rounds first, discarded."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def choices_file(lib: Library) -> Path:
    """Where ``lib``'s measured decisions are stored (``<library>.choices.json``)."""
    return lib.choices_path


def _read_choices(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, choice: Choice) -> None:
    """Add ``key``'s decision to the choices file ``path`` (read, merge, atomic write)."""
    record = {"use_kernel": choice.use_kernel, "reason": choice.reason,
              "timings": [list(t) for t in choice.timings]}  # fmt: skip
    try:
        data = _read_choices(path)
        data[key] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError as exc:  # a read-only cache: decide again next time
        logger.debug("could not store the decision in %s: %s", path, exc)


def _describe(title: str, lib: Library, choice: Choice) -> str:
    parts = [f"{t / k:.2g}× torch {what}" for what, k, t in choice.timings if k > 0]
    side = "kernel used" if choice.use_kernel else "torch used"
    return f"{title} ({lib.label}): {', '.join(parts) or choice.reason}: {side}"


def measured_choice(
    path: Path,
    key: str,
    measure: Callable[[], Sequence[tuple[str, float, float]]],
    *,
    describe: Callable[[Choice], str],
    min_speedup: float = 1.0,
    reason: str = "measured",
    decide: Callable[[Sequence[tuple[str, float, float]]], bool] | None = None,
) -> Choice:
    """Measure, then choose, once per machine: the decision stored under ``key`` in the JSON
    file ``path`` (this process's, else the file's), else ``measure()``-d — ``(what, candidate
    seconds, reference seconds)`` per case, timed in the same moment — with the candidate (a
    kernel, a precision, ...) kept only if it is at least ``min_speedup`` times faster in every
    case (or where ``decide(timings)`` says, for another rule). A new decision is stored in
    ``path``; each is logged once at INFO as ``describe(choice)``. The one mechanism behind
    :func:`choose` and :func:`scpdr.training.precision.resolve_precision`."""
    memo = (str(path), key)
    found = _STATE.choices.get(memo)
    if found is not None:
        return found
    with _STATE.lock:
        if memo in _STATE.choices:
            return _STATE.choices[memo]
        record = _read_choices(path).get(key)
        if isinstance(record, dict) and isinstance(record.get("use_kernel"), bool):
            timings = tuple((str(w), float(k), float(t)) for w, k, t in record.get("timings") or ())
            choice = Choice(record["use_kernel"], str(record.get("reason", "stored")), timings)
            stored = True
        else:
            timings = tuple((str(w), float(k), float(t)) for w, k, t in measure())
            # at least min_speedup: t / k >= min_speedup, as decide_precision compares it
            if decide is not None:
                faster = bool(timings) and all(k > 0 for _, k, _ in timings) and decide(timings)
            else:
                faster = bool(timings) and all(
                    k > 0 and t / k >= min_speedup for _, k, t in timings
                )
            choice = Choice(faster, reason, timings)
            stored = False
        logger.info("%s%s", describe(choice), " (stored decision)" if stored else "")
        if not stored:
            _store(path, key, choice)
        _STATE.choices[memo] = choice
        return choice


def choose(
    lib: Library,
    shape: str,
    measure: Callable[[], Sequence[tuple[str, float, float]]],
    *,
    title: str,
    decide: Callable[[Sequence[tuple[str, float, float]]], bool] | None = None,
    side: Side | None = None,
) -> Choice:
    """Kernel or torch for the shape class ``shape`` of ``lib``: forced by :func:`policy`,
    else remembered (this process, then ``<library>.choices.json``), else ``measure()``-d —
    ``(what, kernel seconds, torch seconds)`` per case, timed in the same moment — and the
    kernel kept only if it is faster in every case, or where ``decide(timings)`` says
    (:func:`measured_choice`). Logged once at INFO as ``title``. ``side``: the policy, where
    the caller has just read it (a per-step caller reads it once)."""
    side = policy(lib.name) if side is None else side
    if side != "auto":
        return Choice(side == "kernel", f"forced ({SWITCHES[lib.name]} or scpdr.kernels.force)")
    return measured_choice(
        choices_file(lib),
        shape,
        measure,
        describe=lambda choice: _describe(title, lib, choice),
        reason="measured against torch",
        decide=decide,
    )


def remembered(lib: Library, shape: str, choice: Choice, *, title: str) -> Choice:
    """Record a decision made without measuring (e.g. an ISA without a tile), logged once."""
    key = (str(choices_file(lib)), shape)
    with _STATE.lock:
        if key not in _STATE.choices:
            logger.info("%s", _describe(title, lib, choice))
            _STATE.choices[key] = choice
        return _STATE.choices[key]


def decisions() -> dict[str, dict[str, object]]:
    """This process's kernel/torch decisions, for reports: ``{"<kernel> (<isa>, <target>
    build) <shape class>": {"use_kernel": bool, "speedups": {what: torch/kernel time}}}``.
    ``use_kernel`` is whether the measured candidate was taken: the kernel over torch, except
    for the packed GEMM's shape classes that name another candidate (``prefetch-...``: the
    next-panel prefetch on; ``q4-...``: GGUF Q4_1 blocks over float32 panels;
    ``torch-rows<N>-...``: torch's matmuls over the kernel from N rows), whose ``speedups``
    are then reference time over the candidate's."""
    with _STATE.lock:
        items = list(_STATE.choices.items())
    libs = {str(choices_file(lib)): lib for lib in _STATE.libraries.values() if lib is not None}
    out: dict[str, dict[str, object]] = {}
    for (path, shape), choice in items:
        lib = libs.get(path)
        if lib is None:  # another measured decision (:func:`measured_choice`), not a kernel's
            continue
        name = f"{lib.name} ({lib.label})"
        speedups = {w: round(v, 3) for w, v in choice.speedups.items()}
        out[f"{name} {shape}"] = {"use_kernel": choice.use_kernel, "speedups": speedups}
    return out
