"""CP-Fuse's grid statistics kernel (``cp_fuse.c``): for a lattice grid ``(b1, b2) = step·(i,
j)`` the three sums per grid point that CP-Fuse's objective needs, from two exponentials per
token (``scpdr.naf.cp_fuse``, Abad et al. 2025)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from scpdr.kernels import build

__all__ = ["MAX_POWER", "NAME", "chosen", "library", "run"]

#: The kernel's name (its C source, its switch in :data:`build.SWITCHES`).
NAME = "cp_fuse"
#: Largest lattice index the kernel takes (i, j < MAX_POWER).
MAX_POWER = 32
#: Rows the first-use measurement times (the cost per row is the same for every row).
MEASURE_ROWS = 2
_TITLE = "CP-Fuse statistics kernel"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _configure(lib: ctypes.CDLL) -> str:
    fn = lib.cp_fuse_stats_f32
    fn.restype = ctypes.c_int
    # lp (2, n, V) float32, n, V, step, ni, nj, out (n, ni, 3 nj) float64, threads
    fn.argtypes = [_PTR, _I64, _I64, ctypes.c_float, _I64, _I64, _PTR, _I64]
    lib.scpdr_cp_fuse_max_power.restype = _I64
    if lib.scpdr_cp_fuse_max_power() != MAX_POWER:
        raise RuntimeError("cp_fuse.c and scpdr.kernels.cp_fuse disagree on MAX_POWER")
    lib.scpdr_cp_fuse_isa.restype = ctypes.c_char_p
    return lib.scpdr_cp_fuse_isa().decode()


def library(target: str | None = None) -> build.Library | None:
    """The ``cp_fuse`` build for ``target`` (default :func:`build.default_target`), or None when
    it cannot be built here (a warning, once)."""
    return build.load(
        NAME,
        what="CP-Fuse: the grid statistics CPU kernel",
        configure=_configure,
        target=target,
        openmp=True,
    )


def run(
    lib: build.Library, lp: Tensor, step: float, ni: int, nj: int, *, threads: int | None = None
) -> Tensor:
    """``S`` ``(n, ni, 3·nj)`` float64 of float32 log-probs ``lp`` ``(2, n, V)`` (CPU):
    ``S[r, i, q] = sum_t u^i W_q`` with ``u = exp(step·l1)``, ``w = exp(step·l2)``, ``W_q`` =
    ``w^q`` (q < nj), ``w^(q-nj)·l1`` (q < 2 nj), ``w^(q-2nj)·l2``. The rows are split over
    ``threads`` threads (default torch's; an OpenMP build only, from 2 rows of ~16k tokens):
    each row is computed by one thread, so the result is the same for any thread count."""
    lpc = lp.contiguous()
    n, vocab = lpc.shape[1], lpc.shape[2]
    out = torch.empty((n, ni, 3 * nj), dtype=torch.float64)
    threads = torch.get_num_threads() if threads is None else threads
    rc = lib.cdll.cp_fuse_stats_f32(lpc.data_ptr(), n, vocab, step, ni, nj, out.data_ptr(), threads)
    if rc == -2:
        raise MemoryError("cp_fuse_stats_f32: out of memory")
    if rc != 0:
        raise ValueError(f"cp_fuse_stats_f32 does not take ni = {ni}, nj = {nj}, step = {step}")
    return out


def chosen(
    lp: Tensor,
    ni: int,
    nj: int,
    kernel_impl: Callable[[Tensor, build.Library], object],
    torch_impl: Callable[[Tensor], object],
) -> build.Library | None:
    """The library to compute CP-Fuse's step on ``lp`` ``(2, n, V)`` with, or None for torch:
    it builds, the lattice fits (``ni, nj <= MAX_POWER``), and it is forced on or measured
    faster — ``kernel_impl(rows, library)`` against ``torch_impl(rows)`` on the first
    :data:`MEASURE_ROWS` rows — for this vocabulary size."""
    if lp.device.type != "cpu" or max(ni, nj) > MAX_POWER:
        return None
    side = build.policy(NAME)
    if side == "torch":
        return None
    lib = library()
    if lib is None or side == "kernel":
        return lib
    rows = lp[:, :MEASURE_ROWS]
    vocab = lp.shape[-1]

    def measure() -> list[tuple[str, float, float]]:
        med = build.interleaved_medians(
            {"kernel": lambda: kernel_impl(rows, lib), "torch": lambda: torch_impl(rows)}, repeats=3
        )
        what = f"at {rows.shape[1]} rows, V = {vocab}, {ni} x {nj} lattice"
        return [(what, med["kernel"], med["torch"])]

    shape = f"V{1 << max(0, (vocab - 1).bit_length())}-lattice{ni}x{nj}"
    return lib if build.choose(lib, shape, measure, title=_TITLE, side=side).use_kernel else None
