"""Running an experiment: :func:`run_experiment` plans the stages (:mod:`scpdr.experiment.plan`),
hands the stage graph to an executor, shows progress and publishes the report.

The executor seam (:mod:`scpdr.experiment.executors`): an :class:`Executor` receives the
:class:`~scpdr.experiment.plan.StageGraph` and a :class:`StageJob` (picklable: the output dir, the
config, which stages are forced) and runs every stage once its dependencies are done, through the
job, so every executor writes the same content-addressed cache
(:class:`~scpdr.experiment.cache.StageCache`). :class:`LocalExecutor` runs the ready stages one at
a time in this process (the default); the Ray executor runs independent stages in parallel as Ray
tasks. Both report each stage's start and end to the same progress display, which lists the
stages running at the moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from scpdr.errors import ConfigError
from scpdr.experiment.cache import Stage, StageCache, StageOutcome, run_lock
from scpdr.experiment.config import ExperimentConfig, load_config
from scpdr.experiment.executors import Executor, LocalExecutor, StageJob
from scpdr.experiment.peak import peak_text
from scpdr.experiment.plan import StageGraph, matches_stage, plan
from scpdr.io import read_json

__all__ = [
    "Executor",
    "ExperimentResult",
    "LocalExecutor",
    "StageJob",
    "StageRunner",
    "planned",
    "run_experiment",
]

logger = logging.getLogger(__name__)


class StageRunner:
    """Runs stages in dependency order under ``out/stages`` with content-hash caching, through
    an executor (default :class:`LocalExecutor`).

    Layout: ``out/stages/<name>/<hash16>/`` (done: holds ``_stage.json``) and
    ``out/stages/<name>/<hash16>.partial/`` (in progress; kept across interruptions so the next
    run resumes in it).
    """

    def __init__(
        self,
        out: Path,
        config: ExperimentConfig,
        *,
        progress: bool = True,
        executor: Executor | None = None,
    ) -> None:
        self.out = Path(out)
        self.config = config
        self.progress = progress
        self.executor = executor if executor is not None else LocalExecutor()
        self.cache = StageCache(self.out)
        self.outcomes: dict[str, StageOutcome] = {}

    def stage_dir(self, stage: Stage) -> Path:
        return self.cache.stage_dir(stage)

    def is_done(self, stage: Stage) -> bool:
        return self.cache.is_done(stage)

    def collect_garbage(self, stages: Sequence[Stage]) -> list[Path]:
        """Remove cached dirs of the planned stage names whose hash is not planned any more."""
        return self.cache.collect_garbage(stages)

    def run_all(self, stages: Sequence[Stage], *, force: Sequence[str] = ()) -> list[StageOutcome]:
        """Run ``stages`` (and their dependencies); ``force``: names or globs of stages to re-run
        even when cached (:func:`~scpdr.experiment.plan.matches_stage`)."""
        graph = StageGraph(stages)
        forced = frozenset(
            s.key for s in graph.order if any(matches_stage(s, pat) for pat in force)
        )
        job = StageJob(self.out, self.config, forced)
        with _progress(self.progress, len(graph)) as advance:
            self.outcomes = self.executor.run(graph, job, advance, done=self.outcomes)
        return [self.outcomes[s.key] for s in graph.order]

    def close(self) -> None:
        """Drop what the executor keeps in memory (loaded models)."""
        close = getattr(self.executor, "close", None)
        if callable(close):
            close()


@dataclasses.dataclass
class ExperimentResult:
    """What :func:`run_experiment` returns."""

    out: Path
    rows: list[dict[str, Any]]
    outcomes: list[StageOutcome]
    report_md: Path
    report_html: Path
    results_json: Path
    main_table: Any  # scpdr.report.Table

    @property
    def ran(self) -> list[str]:
        return [o.name for o in self.outcomes if o.status == "ran"]

    @property
    def cached(self) -> list[str]:
        return [o.name for o in self.outcomes if o.status == "cached"]


def run_experiment(
    config: ExperimentConfig | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: Sequence[str] = (),
    progress: bool = True,
    keep_stale: bool = False,
    executor: Executor | None = None,
) -> ExperimentResult:
    """Run (or resume) every stage of ``config`` under ``out`` and publish the report.

    ``out`` receives ``results.json``, ``report.md``, ``report.html``, ``plots/`` and the stage
    cache ``stages/``. ``force``: stage names or glob patterns (``"attack/*"``, ``"train"``) to
    re-run even when cached. Cached dirs of the same stages with outdated hashes are deleted
    unless ``keep_stale``. ``executor``: how the stages run (default :class:`LocalExecutor`).
    """
    config, stages, report = planned(config)
    _check_base(config)
    out = Path(out)
    with run_lock(out):
        runner = StageRunner(out, config, progress=progress, executor=executor)
        try:
            with _quiet_hf_progress():
                outcomes = runner.run_all([*stages, report], force=force)
        finally:
            runner.close()
        if not keep_stale:
            removed = runner.collect_garbage([*stages, report])
            if removed:
                logger.info("removed %d outdated stage dir(s)", len(removed))
        report_dir = runner.stage_dir(report)
        _publish(report_dir, out)
    rows = read_json(out / "results.json")
    from scpdr.report.tables import main_table

    table = main_table(
        rows,
        methods=config.all_methods,
        corpus_labels={c.name: c.resolved_label for c in config.corpora},
    )
    return ExperimentResult(
        out=out,
        rows=rows,
        outcomes=outcomes,
        report_md=out / "report.md",
        report_html=out / "report.html",
        results_json=out / "results.json",
        main_table=table,
    )


def planned(
    config: ExperimentConfig | str | os.PathLike[str],
) -> tuple[ExperimentConfig, list[Stage], Stage]:
    """(config, stages, report stage) exactly as :func:`run_experiment` runs them; the report
    embeds the config file's text (the resolved config when it ``extends`` another)."""
    config_text: str | None = None
    if not isinstance(config, ExperimentConfig):
        config_text = Path(config).read_text(encoding="utf-8")
        config = load_config(config)
        if re.search(r"^extends\s*:", config_text, flags=re.MULTILINE):
            config_text = None  # show the resolved config, not just the overrides
    stages, report = plan(config)
    report.inputs["config_text"] = config_text or _dump_yaml(config)
    report.rehash()  # with the config text
    return config, stages, report


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    """No transformers progress bars (loading/writing weights) under the stage display."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_base(cfg: ExperimentConfig) -> None:
    if cfg.base in ("embedded", "tiny"):
        return
    if not Path(cfg.base).expanduser().exists():
        raise ConfigError(
            f"base: model {cfg.base!r} does not exist; give an HF model directory or a .gguf file "
            "(relative to the config file), or 'embedded' for SmolLM2-135M-Instruct"
        )


def _dump_yaml(cfg: ExperimentConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _publish(report_dir: Path, out: Path) -> None:
    """Copy the report stage's outputs to the top of ``out`` (atomically per file)."""
    from scpdr.io import atomic_write

    for name in ("results.json", "report.md", "report.html"):
        src = report_dir / name
        atomic_write(out / name, lambda p, src=src: shutil.copyfile(src, p))
    plots_src = report_dir / "plots"
    plots_dst = out / "plots"
    if plots_dst.exists():
        shutil.rmtree(plots_dst)
    if plots_src.is_dir():
        shutil.copytree(plots_src, plots_dst)


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[..., None]]:
    """A rich progress display over the stages: one line per stage as it finishes."""
    if not enabled:

        def quiet(name: str, status: str, outcome: StageOutcome | None) -> None:
            if status != "running":
                logger.info("stage %s: %s%s", name, status, _fmt_outcome(outcome))

        yield quiet
        return
    from rich.console import Console
    from rich.markup import escape as rich_escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True, log_path=False)
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]stages[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("", total=total)
        running: dict[str, None] = {}  # the stages running now, in the order they started

        def advance(name: str, status: str, outcome: StageOutcome | None) -> None:
            if status == "running":
                running[name] = None
            else:
                running.pop(name, None)
                style = "green" if status == "ran" else "dim"
                label = rich_escape(name)  # a sweep label holds "[m=100]"
                progress.console.log(f"[{style}]{status:>6}[/] {label}{_fmt_outcome(outcome)}")
            progress.update(
                task, advance=0 if status == "running" else 1, description=_running_text(running)
            )

        yield advance


def _running_text(running: dict[str, None]) -> str:
    """The progress line's description: the first stage running, and how many more run beside it
    (an executor that runs stages in parallel)."""
    if not running:
        return ""
    from rich.markup import escape as rich_escape

    first = rich_escape(next(iter(running)))
    more = f" [dim](+{len(running) - 1} running)[/]" if len(running) > 1 else ""
    return f"[cyan]{first}[/] …{more}"


def _fmt_outcome(outcome: StageOutcome | None) -> str:
    """`` (12.3 s, peak 1.9 GiB)`` for a stage that ran; nothing for one found in the cache."""
    if outcome is None or outcome.status != "ran":
        return ""
    parts = [f"{outcome.seconds:.1f} s"]
    if outcome.peak_mib is not None:
        parts.append(peak_text(outcome.peak_mib))
    return f" ({', '.join(parts)})"
