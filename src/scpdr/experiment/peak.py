"""Peak resident memory of one stage, for the stage log and its marker.

A process's own high-water mark (``ru_maxrss``, ``VmHWM``) covers everything it ran before, and
the local executor runs every stage in one process, so it cannot say which stage needed the
memory. Resetting it (``/proc/self/clear_refs``) would also lower what ``/usr/bin/time`` and
``getrusage`` report for the whole run. So a daemon thread samples the process's resident set
(``psutil``) while the stage runs, every :data:`INTERVAL` seconds, and the peak is the largest
sample, taken at the start and the end too: a spike shorter than the interval can be missed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

__all__ = ["INTERVAL", "StagePeak", "peak_text", "rss_bytes", "sampled_peak"]

#: Seconds between two samples of the resident set.
INTERVAL = 0.05


def rss_bytes() -> int | None:
    """This process's resident set size in bytes now, or None where it cannot be read."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except (ImportError, OSError):
        return None


def peak_text(mib: float) -> str:
    """``"peak 3.1 GiB"`` for a peak of ``mib`` MiB: the stage log's wording."""
    return f"peak {mib / 1024:.1f} GiB"


@dataclasses.dataclass
class StagePeak:
    """The largest resident set sampled while a block ran (``bytes``; None: not readable here)
    and how many samples it took."""

    bytes: int | None = None
    samples: int = 0

    def add(self, value: int | None) -> None:
        if value is not None:
            self.bytes = value if self.bytes is None else max(self.bytes, value)
            self.samples += 1

    @property
    def mib(self) -> float | None:
        return None if self.bytes is None else round(self.bytes / 2**20, 1)

    def describe(self) -> str:
        """``"peak 3.1 GiB"`` (``""`` where nothing was read)."""
        return "" if self.bytes is None else peak_text(self.bytes / 2**20)


@contextlib.contextmanager
def sampled_peak(interval: float = INTERVAL) -> Iterator[StagePeak]:
    """The resident set's peak while the block runs (module docstring), filled in on exit."""
    peak = StagePeak()
    peak.add(rss_bytes())
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            peak.add(rss_bytes())

    thread = threading.Thread(target=sample, name="scpdr-stage-rss", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak.add(rss_bytes())
