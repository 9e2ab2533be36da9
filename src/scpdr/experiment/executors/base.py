"""The executor seam of ``scpdr experiment``: an :class:`Executor` runs the stages of a
:class:`~scpdr.experiment.plan.StageGraph`, each once its dependencies are done, through a
:class:`StageJob` — which runs one stage into the content-addressed cache
(:meth:`~scpdr.experiment.cache.StageCache.run`), so every executor writes the same layout and a
run started by one executor resumes under another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from scpdr.experiment.cache import Stage, StageCache, StageOutcome

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.experiment.config import ExperimentConfig
    from scpdr.experiment.plan import StageGraph

__all__ = ["Advance", "Executor", "StageJob"]

#: ``advance(label, status, outcome)``: status "running" (outcome None), "ran" or "cached".
Advance = Callable[[str, str, "StageOutcome | None"], None]


@dataclasses.dataclass(frozen=True)
class StageJob:
    """Runs one stage into the cache under ``out`` (:meth:`StageCache.run`); picklable, so an
    executor may call it in another process on a shared filesystem."""

    out: Path
    config: ExperimentConfig
    forced: frozenset[str] = frozenset()  # keys of the stages re-run even when cached

    def __call__(
        self,
        stage: Stage,
        *,
        memo: dict[Any, Any] | None = None,
        on_start: Callable[[Stage], None] | None = None,
    ) -> StageOutcome:
        return StageCache(self.out).run(
            stage, self.config, force=stage.key in self.forced, memo=memo, on_start=on_start
        )

    def cached(self, stage: Stage) -> StageOutcome | None:
        """The outcome of ``stage`` when it is done in the cache and not forced, else None (a
        file check: an executor need not send a finished stage anywhere)."""
        cache = StageCache(self.out)
        if stage.key in self.forced or not cache.is_done(stage):
            return None
        return StageOutcome(stage.name, stage.hash, "cached", 0.0, cache.stage_dir(stage))


class Executor(Protocol):
    """Runs the stages of a graph, each after the stages it depends on."""

    def run(
        self,
        graph: StageGraph,
        job: StageJob,
        advance: Advance,
        done: Mapping[str, StageOutcome] | None = None,
    ) -> dict[str, StageOutcome]:
        """Run every stage of ``graph`` not in ``done`` (stage key → outcome) through ``job``;
        call ``advance(stage.label, "running", None)`` when one starts and
        ``advance(stage.label, outcome.status, outcome)`` when it ends. Returns the
        outcome of every stage of the graph by key."""
        ...
