"""Each stage's peak resident memory, sampled while it runs (:mod:`scpdr.experiment.peak`):
in its marker and in the stage log, its own and not the process's so far."""

from __future__ import annotations

import json
import logging
import mmap
import time
from pathlib import Path

import numpy as np
import yaml

from scpdr.experiment import MARKER, Stage, StageRunner, validate_config
from scpdr.experiment.peak import rss_bytes, sampled_peak

MIB = 2**20
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _hold(mib: int, seconds: float) -> None:
    """Hold ``mib`` MiB of written memory for ``seconds``, then free it. The memory is an
    anonymous mapping of its own, so its pages are new whatever the process did before, and
    leave the resident set when it is unmapped. (A ``malloc``-ed block, a large numpy array
    included, is served from the heap's free chunks before any new mapping: after earlier
    tests left that much free but resident heap, holding it raised the RSS by nothing.)"""
    buf = mmap.mmap(-1, mib * MIB)
    view = np.frombuffer(buf, dtype=np.uint8)
    view.fill(1)
    time.sleep(seconds)
    del view
    buf.close()


def _leave_free_resident_heap(mib: int) -> None:
    """Leave ``mib`` MiB of freed heap that stays resident (glibc keeps it below a block still
    in use), as a run of earlier tests can: the condition under which ``_hold`` once saw
    nothing."""
    np.ones(16 * MIB // 8)  # freed at once: glibc's mmap threshold rises to 16 MiB
    blocks = [np.ones(MIB // 8) for _ in range(mib)]  # 1 MiB each: now on the heap
    _LEFT.append(np.ones(MIB // 8))  # above them, kept
    del blocks


_LEFT: list = []


def test_the_peak_is_the_blocks_largest_sample():
    _leave_free_resident_heap(320)
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
