"""benchmarks/bench_train.py runs end to end on the tiny model (--tiny --quick) and ends with its
JSON line: the three figures, their goals, and the numbers behind them (a smoke test of the
script: the tiny model's numbers say nothing about the 135M model's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"


def test_bench_train_tiny_quick_prints_its_json_line():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "train" and line["model"] == "tiny"
    ratios = line["ratios"]
    assert set(ratios) == {"tokens_per_s", "padding_share", "peak_rss_gb"}
    assert set(line["goals"]) == set(ratios) == set(line["goals_met"])
    tps = line["tokens_per_s"]
    # tokens_per_s are printed to 0.1, the ratio from the unrounded ones
    assert ratios["tokens_per_s"] == pytest.approx(tps["scpdr"] / tps["hf"], rel=1e-2)
    assert ratios["tokens_per_s"] > 0
    assert set(tps) == {
        "scpdr",
        "hf",
        "scpdr-model-loss",
        "scpdr-no-checkpointing",
        "scpdr-no-trim-heap",
    }
    assert line["chunked_loss_speedup"] > 0 and line["checkpointing_cost"] > 0
    assert line["heap_trim_cost"] > 0
    assert line["checkpointing"] is True  # scpdr's step as scpdr train runs it on CPU
    assert line["trim_heap"] is True
    assert line["lora_dropout_speedup"] > 0
    # grouped batches pad less than random ones on the skewed lengths
    assert ratios["padding_share"] == line["padding_share"]["scpdr"] < line["padding_share"]["hf"]
    assert 0 < ratios["peak_rss_gb"] == line["peak_rss_gb"]["scpdr"]
    assert set(line["peak_rss_gb"]) == {"scpdr"}  # --tiny --quick: one RSS process
    assert all(v > 0 for v in line["peak_rss_gb"].values())
    assert line["precision"]["precision"] in ("fp32", "bf16")
    assert line["goals"]["tokens_per_s"] == (1.8 if line["bf16_units"] else 1.0)
