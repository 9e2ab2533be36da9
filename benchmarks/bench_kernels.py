"""The C kernels alone against torch, for each ISA build, and the register tiles the packed GEMM
could use.

- ``gemm``: one layer of the embedded SmolLM2-135M (q, k, v, o, gate, up, down), four copies
  (~56 MB: more than the L3, so that the weights stream from memory as in decoding), at 1, 3, 8
  and 24 rows: the packed kernel against ``F.linear`` (MKL), for the build's own tile and, with
  ``--tiles``, the same without its next-panel prefetch and the alternative tiles of its ISA
  (``-DSCPDR_TILE_MR``/``-DSCPDR_TILE_NV``);
- ``scp-delta-r``: the fused kernel against :func:`scpdr.naf.scp_delta_r_torch` at V = 49152,
  K = 2, m = 10, batch 1 and 8, and at the largest size used without measuring
  (:data:`scpdr.kernels.scp.SMALL_ELEMENTS`);
- ``cp-fuse``: :func:`scpdr.naf.cp_fuse_step` (statistics kernel) against
  :func:`scpdr.naf.cp_fuse_reference` at batch 1 and 8.

This thread's CPU time with one torch thread (robust to other load on a shared machine); each
comparison interleaved. Ratios are torch time / kernel time (> 1: the kernel is faster).

    python benchmarks/bench_kernels.py [--quick] [--targets ...] [--tiles]

Last stdout line: ``{"bench": "kernels", "ratios": {...native...}, "isa": {"native": {...},
"x86-64-v3": {...}}, ...}``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, default_targets, emit, interleaved_medians, setup

logger = logging.getLogger("scpdr.benchmarks.kernels")

#: (in, out) of one SmolLM2-135M layer's linears.
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
ROWS = (1, 3, 8, 24)
#: Register tiles (MR rows, NV vectors) per ISA: the build's own first, then the alternatives
#: --tiles times.
TILES = {
    "avx512": [(12, 2), (6, 4), (8, 3)],
    "avx2": [(4, 3), (6, 2), (3, 4), (6, 8)],  # 6 x 8 vectors: the first version's 6 x 64 tile
}


def gemm_case(
    lib_path: Path, copies: int, repeats: int, *, prefetch: bool = True
) -> dict[str, float]:
    """``{"at N rows": torch / kernel}`` for a packed_gemm build at ``lib_path`` (with its
    next-panel prefetch on or off)."""
    import torch

    from scpdr.kernels.gemm import pack_panels

    lib = ctypes.CDLL(str(lib_path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.scpdr_gemm_packed_f32
    fn.argtypes, fn.restype = [i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int, i64], None
    lib.scpdr_panel_width.restype = i64
    lib.scpdr_gemm_set_prefetch.argtypes = [ctypes.c_int]
    lib.scpdr_gemm_set_prefetch(1 if prefetch else 0)
    width = lib.scpdr_panel_width()
    shapes = LAYER * copies
    ws = [torch.full((o, i), 0.01) for i, o in shapes]
    packed = [pack_panels(w, width) for w in ws]
    out = {}
    for rows in ROWS:
        xs = {i: torch.randn(rows, i) for i in {s[0] for s in shapes}}
        ys = [torch.empty(rows, o) for _, o in shapes]

        def kernel(xs=xs, ys=ys, rows=rows) -> None:
            for (i, o), p, y in zip(shapes, packed, ys, strict=True):
                fn(rows, o, i, xs[i].data_ptr(), i, p.data_ptr(), y.data_ptr(), o, 0, 1)

        def reference(xs=xs) -> None:
            for (i, _), w in zip(shapes, ws, strict=True):
                torch.nn.functional.linear(xs[i], w)

        med = interleaved_medians({"k": kernel, "t": reference}, repeats=repeats, clock="cpu")
        out[f"at {rows} rows"] = round(med["t"] / med["k"], 3)
        out[f"ms at {rows} rows"] = round(med["k"] * 1e3, 3)
    return out


def gemm_tiles(target: str, isa: str, tiles: bool, copies: int, repeats: int) -> dict:
    from scpdr.kernels import build

    source = build.kernel_source("packed_gemm")
    compiler = os.environ.get("CC") or "cc"
    out = {}
    alternatives = TILES.get(isa, [])[1:] if tiles else []
    # None: the build's own tile; "no prefetch": the same without its next-panel prefetch
    for tile in [None, *(["no prefetch"] if tiles else []), *alternatives]:
        extra = ["-fopenmp"]
        if isinstance(tile, tuple):
            extra += [f"-DSCPDR_TILE_MR={tile[0]}", f"-DSCPDR_TILE_NV={tile[1]}"]
        path = build.compile_library("packed_gemm", source, compiler, target, extra)
        label = (
            tile if isinstance(tile, str) else "default" if tile is None else "{}x{}".format(*tile)
        )
        out[label] = gemm_case(path, copies, repeats, prefetch=tile != "no prefetch")
        logger.info("gemm %s (%s) tile %s: %s", target, isa, label, out[label])
    return out


def scp_cases(target: str, repeats: int) -> dict[str, float]:
    import torch

    from scpdr import kernels, naf

    lib = kernels.scp.library(target=target)
    out = {}
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 49152), (8, 49152), (1, kernels.scp.SMALL_ELEMENTS // 2), (1, 100)]
    for rows, vocab in sizes:
        shared = torch.randn(rows, vocab, generator=g) * 3
        x = shared + torch.randn(2, rows, vocab, generator=g)
        base = shared + torch.randn(rows, vocab, generator=g)
        med = interleaved_medians(
            {
                "k": partial(kernels.scp.run, lib, x, base, 10),
                "t": partial(naf.scp_delta_r_torch, x, base=base, m=10),
            },
            repeats=repeats,
            clock="cpu",
        )
        out[f"B{rows} V{vocab}"] = round(med["t"] / med["k"], 3)
        out[f"ms B{rows} V{vocab}"] = round(med["k"] * 1e3, 3)
    return out


def cp_fuse_cases(target: str, repeats: int) -> dict[str, float]:
    import torch

    from scpdr import kernels, naf

    out = {}
    g = torch.Generator().manual_seed(1)
    for rows in (1, 8):
        shared = torch.randn(rows, 49152, generator=g) * 3
        x = shared + torch.randn(2, rows, 49152, generator=g)
        path = torch.zeros(2, rows)
        with kernels.using_target(target), kernels.force("cp_fuse", "kernel"):
            fns = {
                "k": partial(naf.cp_fuse_step, x, path),
                "t": partial(naf.cp_fuse_reference, x, path),
            }
            med = interleaved_medians(fns, repeats=repeats, warmup=1, clock="cpu")
        out[f"B{rows}"] = round(med["t"] / med["k"], 3)
        out[f"ms B{rows}"] = round(med["k"] * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under 5 minutes)")
    ap.add_argument("--targets", nargs="+", default=None, help="builds besides native")
    ap.add_argument("--tiles", action="store_true", help="also time the alternative tiles")
    args = ap.parse_args(argv)
    setup(threads=1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    import torch

    from scpdr import kernels

    targets = ["native", *(args.targets if args.targets is not None else default_targets())]
    repeats = 5 if args.quick else 15
    isa: dict[str, dict] = {}
    with torch.inference_mode():
        for target in targets:
            gemm = kernels.gemm.library(target=target)
            name = gemm.lib.isa if gemm is not None else None
            isa[target] = {
                "isa": name,
                "gemm": gemm_tiles(target, name or "", args.tiles, 4, repeats),
                "scp-delta-r": scp_cases(target, repeats),
                "cp-fuse": cp_fuse_cases(target, max(3, repeats // 3)),
            }
            logger.info("%s: %s", target, isa[target])
    native = isa["native"]
    ratios = {f"gemm {k}": v for k, v in native["gemm"].get("default", {}).items() if "ms" not in k}
    ratios |= {f"scp-delta-r {k}": v for k, v in native["scp-delta-r"].items() if "ms" not in k}
    ratios |= {f"cp-fuse {k}": v for k, v in native["cp-fuse"].items() if "ms" not in k}
    emit("kernels", ratios, isa=isa, clock="cpu", threads=1, load_average=load, cpu=cpu_model())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
