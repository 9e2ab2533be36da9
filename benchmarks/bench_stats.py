"""Cost of the membership suite's bootstrap: :func:`scpdr.attacks.stats.ranked_weighted_roc` (ranks
against the replicates' cumulative weights, O(R · (M + N))) vs its pairwise definition
:func:`scpdr.attacks.stats.pairwise_weighted_roc` (O(R · M · N)), on the bootstrap weights
:func:`scpdr.attacks.stats.roc_metrics` draws (R = 1000 replicates), M = N members and
non-members, measured round-robin in the same run. ``weighted_roc`` takes the pairwise form
below ``PAIRWISE_MAX_PAIRS`` pairs, where it is the faster one (the ratio < 1 at 10 of each).

An audit with 200 members costs little either way; one with thousands (a user's own records)
paid 28 s per attack and method at M = N = 5000 with the pairwise form.

    python benchmarks/bench_stats.py [--quick]

Last stdout line: ``{"bench": "stats", "ratios": {"pairwise/fast@<n>": ...}, "ms": {...}}``
(a ratio > 1: the fast path is that many times faster). Both paths are checked equal first.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_model, emit, interleaved_medians, setup

from scpdr.attacks.stats import FPR_LEVELS, N_BOOT, pairwise_weighted_roc, ranked_weighted_roc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = ap.parse_args()
    setup()
    sizes = (10, 40, 200, 1000) if args.quick else (10, 40, 200, 1000, 3000)
    repeats = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    ratios: dict[str, float | None] = {}
    ms: dict[str, float] = {}
    for n in sizes:
        mem, non = rng.normal(0.3, 1, n).round(2), rng.normal(0, 1, n).round(2)  # ties too
        v = rng.multinomial(n, np.full(n, 1 / n), size=N_BOOT).astype(float)
        w = rng.multinomial(n, np.full(n, 1 / n), size=N_BOOT).astype(float)
        fast, slow = (
            ranked_weighted_roc(mem, non, v, w, FPR_LEVELS),
            pairwise_weighted_roc(mem, non, v, w, FPR_LEVELS),
        )
        for a, b in zip(fast, slow, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-12)
        args_ = (mem, non, v, w, FPR_LEVELS)
        t = interleaved_medians(
            {
                "fast": partial(ranked_weighted_roc, *args_),
                "pairwise": partial(pairwise_weighted_roc, *args_),
            },
            repeats=repeats,
            warmup=1,
        )
        ratios[f"pairwise/fast@{n}"] = t["pairwise"] / t["fast"]
        ms[f"fast@{n}"], ms[f"pairwise@{n}"] = 1e3 * t["fast"], 1e3 * t["pairwise"]
        print(
            f"M = N = {n}, R = {N_BOOT}: ranked {1e3 * t['fast']:.1f} ms, pairwise "
            f"{1e3 * t['pairwise']:.1f} ms ({ratios[f'pairwise/fast@{n}']:.1f}x)"
        )
    emit("stats", ratios, ms=ms, cpu=cpu_model())


if __name__ == "__main__":
    main()
