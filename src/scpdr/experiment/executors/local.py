"""The default executor: the ready stages one at a time, in this process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scpdr.experiment.cache import StageOutcome
from scpdr.experiment.executors.base import Advance, StageJob

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.experiment.plan import StageGraph

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Runs the ready stages one at a time in this process, in graph order; the stages share one
    ``memo`` (loaded models), dropped by :meth:`close`."""

    def __init__(self) -> None:
        self.memo: dict[Any, Any] = {}

    def run(
        self,
        graph: StageGraph,
        job: StageJob,
        advance: Advance,
        done: Mapping[str, StageOutcome] | None = None,
    ) -> dict[str, StageOutcome]:
        outcomes = dict(done or {})
        for stage in graph.order:
            if stage.key in outcomes:
                advance(stage.label, "cached", outcomes[stage.key])
        while ready := graph.ready(outcomes):
            stage = ready[0]
            outcome = job(
                stage, memo=self.memo, on_start=lambda s: advance(s.label, "running", None)
            )
            advance(stage.label, outcome.status, outcome)
            outcomes[stage.key] = outcome
        return outcomes

    def close(self) -> None:
        self.memo.clear()
