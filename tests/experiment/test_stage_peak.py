"""Each stage's peak resident memory, sampled while it runs (:mod:`scpdr.experiment.peak`):
in its marker and in the stage log, its own and not the process's so far."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import yaml

from scpdr.experiment import MARKER, Stage, StageRunner, validate_config
from scpdr.experiment.peak import rss_bytes, sampled_peak

MIB = 2**20
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _hold(mib: int, seconds: float) -> None:
    """Hold ``mib`` MiB of written memory for ``seconds``, then free it (a large numpy array is
    its own mapping: freed, it leaves the resident set at once)."""
    block = np.ones(mib * MIB // 8)
    time.sleep(seconds)
    del block


def test_the_peak_is_the_blocks_largest_sample():
    before = rss_bytes()
    assert before is not None and before > 0
    with sampled_peak(interval=0.01) as peak:
        _hold(256, 0.3)
    after = rss_bytes()
    assert peak.samples >= 10  # start, end and the thread's samples in between
    assert peak.bytes >= before + 240 * MIB  # the 256 MiB held, seen by a sample
    assert after < peak.bytes - 200 * MIB  # and gone again
    assert peak.describe().startswith("peak ") and peak.describe().endswith(" GiB")


def _stage(name: str, fn, deps=None) -> Stage:
    return Stage(name=name, kind="report", inputs={"n": name}, run=fn, deps=deps or {})


def test_each_stage_records_its_own_peak(tmp_path, caplog):
    """A stage holding 384 MiB, then one holding nothing: the first's peak shows the 384 MiB,
    the second's does not (a process-wide high-water mark would give it the first's)."""

    def big(ctx):
        _hold(384, 0.4)
        (ctx.dir / "done").write_text("1")

    def small(ctx):
        time.sleep(0.2)
        (ctx.dir / "done").write_text("1")

    a = _stage("big", big)
    b = _stage("small", small, deps={"a": a})
    runner = StageRunner(
        tmp_path, validate_config(yaml.safe_load(TINY.read_text())), progress=False
    )
    with caplog.at_level(logging.INFO, logger="scpdr.experiment"):
        outcomes = runner.run_all([b])
    peaks = {o.name: o.peak_mib for o in outcomes}
    for o in outcomes:
        marker = json.loads((runner.stage_dir(a if o.name == "big" else b) / MARKER).read_text())
        assert marker["peak_rss_mib"] == o.peak_mib
    assert peaks["big"] > peaks["small"] + 300
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stage ")]
    assert any(m.startswith("stage big: ran (") and "GiB)" in m for m in logged)
    assert any(m.startswith("stage small: ran (") and "peak " in m for m in logged)
