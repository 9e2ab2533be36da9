"""The Ray executor (``scpdr experiment CONFIG --executor ray [--address ADDR]``): every stage whose
dependencies are done runs as a Ray task, so independent stages (the K constituents of a corpus,
the corpora, the attack stages) run in parallel on a cluster, each with the resources its kind
asks for in the config (``resources: {train: {num_gpus: 1}, attack: {num_gpus: 1}}``).

Every task runs its stage through the same :class:`~scpdr.experiment.executors.base.StageJob` as
the local executor, into the same content-addressed stage cache, so ``out`` must be on a
filesystem every node of the cluster sees at the same path. A stage already done in the cache is
never sent to the cluster; a run that is killed resumes from the cache (a stage interrupted in
its ``.partial`` dir resumes there: the trainer from its last checkpoint).

Ray is an optional dependency (``pip install scpdr[ray]``), imported only when this executor runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scpdr.device import check_device, cuda_index, device_source
from scpdr.errors import ConfigError, missing_dependency
from scpdr.experiment.cache import Stage, StageOutcome
from scpdr.experiment.executors.base import Advance, StageJob

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.experiment.plan import StageGraph

__all__ = ["RayExecutor", "run_stage"]

logger = logging.getLogger(__name__)

# The memo of the stages one Ray worker process runs (loaded models, as in the local executor).
# Ray reuses a worker for CPU tasks; a GPU task's worker exits after it (Ray's default), which
# frees the GPU memory.
_WORKER_MEMO: dict[Any, Any] = {}


def run_stage(job: StageJob, stage: Stage) -> StageOutcome:
    """The body of one Ray task: ``stage`` through ``job``, with this worker's memo (and no
    transformers progress bars: the driver's display shows the stages)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return job(stage, memo=_WORKER_MEMO)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise missing_dependency("ray", extra="ray") from exc
    return ray


class RayExecutor:
    """Runs the ready stages as Ray tasks, as many at a time as the cluster's resources allow.

    Args:
        address: the Ray cluster to connect to (``ray start --head`` prints it; ``"auto"``: the
            one running on this machine). None: the cluster this process is connected to, else
            one started on this machine for the run (and shut down by :meth:`close`).
        init_options: more keyword arguments of ``ray.init`` when this executor connects or
            starts the cluster (e.g. ``num_cpus`` of a local one).
    """

    def __init__(self, address: str | None = None, **init_options: Any) -> None:
        self.address = address
        self.init_options = init_options
        self._owns_cluster = False

    def _connect(self) -> Any:
        ray = _import_ray()
        if not ray.is_initialized():
            options = {"include_dashboard": False, **self.init_options}
            ray.init(address=self.address, **options)
            self._owns_cluster = self.address is None
        return ray

    def run(
        self,
        graph: StageGraph,
        job: StageJob,
        advance: Advance,
        done: Mapping[str, StageOutcome] | None = None,
    ) -> dict[str, StageOutcome]:
        device, source = device_source(job.config.device, option="device:")
        if cuda_index(check_device(device, option=source)) is not None:
            fix = "device: cuda" if source == "device:" else f"{source}=cuda"
            raise ConfigError(
                f"{source} {device} pins one GPU, but under --executor ray each task "
                f"gets its own (resources: {{train: {{num_gpus: 1}}}}); use {fix}"
            )
        outcomes = dict(done or {})
        for stage in graph.order:
            if stage.key in outcomes:
                advance(stage.label, "cached", outcomes[stage.key])
        ray = self._connect()
        remote = ray.remote(run_stage)
        job_ref = ray.put(job)
        in_flight: dict[Any, Stage] = {}
        try:
            while True:
                self._submit_ready(graph, job, job_ref, remote, outcomes, in_flight, advance)
                if not in_flight:
                    break
                finished, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in finished:
                    stage = in_flight.pop(ref)
                    outcome = _result(ray, ref)
                    advance(stage.label, outcome.status, outcome)
                    outcomes[stage.key] = outcome
        finally:
            for ref in in_flight:  # a failed stage or an interrupt: stop the others
                ray.cancel(ref)
        return outcomes

    def _submit_ready(
        self,
        graph: StageGraph,
        job: StageJob,
        job_ref: Any,
        remote: Any,
        outcomes: dict[str, StageOutcome],
        in_flight: dict[Any, Stage],
        advance: Advance,
    ) -> None:
        """Submit every ready stage not yet running; a stage done in the cache is recorded as
        cached right here (which may make more stages ready)."""
        running = {s.key for s in in_flight.values()}
        while True:
            ready = [s for s in graph.ready(outcomes) if s.key not in running]
            hits = [(s, o) for s in ready if (o := job.cached(s)) is not None]
            for stage, outcome in hits:
                advance(stage.label, outcome.status, outcome)
                outcomes[stage.key] = outcome
            if not hits:
                break
        for stage in ready:
            options = job.config.resource_request(stage.kind).ray_options()
            ref = remote.options(name=stage.label, **options).remote(job_ref, stage)
            in_flight[ref] = stage
            advance(stage.label, "running", None)

    def close(self) -> None:
        """Shut down the cluster this executor started (one it connected to keeps running)."""
        if self._owns_cluster:
            ray = _import_ray()
            ray.shutdown()
            self._owns_cluster = False


def _result(ray: Any, ref: Any) -> StageOutcome:
    """The task's outcome; a stage's own error is raised as itself (not wrapped by Ray)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
