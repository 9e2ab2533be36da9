"""End-to-end experiments: one YAML config → cached, resumable stages → ``results.json`` → report.

The pipeline of ``shared/DESIGN.md`` (layer 6)::

    partitions (data + canaries + audit) → train constituents (+ reference / baseline models)
         → bundles → attacks (one stage per corpus × method × attack) → bounds → report

- :mod:`~scpdr.experiment.config` (+ :mod:`~scpdr.experiment.sections`): the pydantic schema,
  :func:`load_config` / :func:`validate_config`; errors name the key path and the fix, e.g.
  ``train.epochs: must be > 0 (got 0)``. The ``train:`` section is the library's
  :class:`scpdr.training.TrainConfig`, a corpus's ``canaries:`` its :class:`scpdr.data.CanaryConfig`.
- :mod:`~scpdr.experiment.cache`: the content-addressed stage cache (hash = inputs + dependency
  hashes + code version; marker written last; ``.partial`` dirs resume), the run lock.
- :mod:`~scpdr.experiment.plan`: config → the stage graph (:func:`plan`), sweeps included.
- :mod:`~scpdr.experiment.stages`, :mod:`~scpdr.experiment.stages_eval`: the stage bodies; every
  attack stage runs the one evaluation pipeline of ``scpdr eval``
  (:mod:`scpdr.attacks.evaluation`).
- :mod:`~scpdr.experiment.run`: :func:`run_experiment`, progress and publishing;
  :mod:`~scpdr.experiment.executors`: the executor seam (:class:`Executor`, :class:`StageJob`),
  :class:`LocalExecutor` (the default) and the Ray executor (:func:`make_executor`).

Re-running skips finished stages; a changed setting changes the hashes of exactly the stages that
depend on it, so only those re-run. Method names are the result-row names of :mod:`scpdr.methods`.
"""

from __future__ import annotations

from scpdr.experiment.cache import (
    MARKER,
    STAGE_VERSIONS,
    Stage,
    StageCache,
    StageContext,
    StageOutcome,
    code_version,
    run_lock,
)
from scpdr.experiment.config import DEFAULT_METHODS, ExperimentConfig, load_config, validate_config
from scpdr.experiment.executors import EXECUTORS, make_executor
from scpdr.experiment.plan import StageGraph, matches_stage, plan
from scpdr.experiment.run import (
    Executor,
    ExperimentResult,
    LocalExecutor,
    StageJob,
    StageRunner,
    planned,
    run_experiment,
)
from scpdr.experiment.sections import (
    ATTACKS,
    BUILTIN_CORPORA,
    AttacksConfig,
    BaselinesConfig,
    BoundsConfig,
    CorpusConfig,
    GoldfishConfig,
    PartitionConfig,
    ReferenceConfig,
    ReportConfig,
    ResourceRequest,
    SweepConfig,
)

__all__ = [
    "ATTACKS",
    "BUILTIN_CORPORA",
    "DEFAULT_METHODS",
    "EXECUTORS",
    "MARKER",
    "STAGE_VERSIONS",
    "AttacksConfig",
    "BaselinesConfig",
    "BoundsConfig",
    "CorpusConfig",
    "Executor",
    "ExperimentConfig",
    "ExperimentResult",
    "GoldfishConfig",
    "LocalExecutor",
    "PartitionConfig",
    "ReferenceConfig",
    "ReportConfig",
    "ResourceRequest",
    "Stage",
    "StageCache",
    "StageContext",
    "StageGraph",
    "StageJob",
    "StageOutcome",
    "StageRunner",
    "SweepConfig",
    "code_version",
    "load_config",
    "make_executor",
    "matches_stage",
    "plan",
    "planned",
    "run_experiment",
    "run_lock",
    "validate_config",
]
