"""``scpdr experiment CONFIG.yaml [--out DIR]``: dataset → partitions → constituents → bundles →
attacks → bounds → report, each stage cached under a content hash (``scpdr.experiment``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from scpdr.experiment import Executor, ExperimentConfig, Stage


def experiment(
    config: Path = typer.Argument(..., help="Experiment config (YAML); see configs/demo.yaml."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output directory (default: runs/<config name>)."
    ),
    force: list[str] = typer.Option(
        [],
        "--force",
        help="Re-run these stages even when cached: a stage name or glob, e.g. 'attack/*' or "
        "'train' (one that matches no stage is an error). Repeatable.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate the config and list the stages (cached or to run)."
    ),
    keep_stale: bool = typer.Option(
        False, "--keep-stale", help="Keep cached stage dirs whose settings are outdated."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress display."),
    executor: str = typer.Option(
        "local",
        "--executor",
        help="How the stages run: 'local' (one at a time in this process) or 'ray' (independent "
        "stages in parallel as Ray tasks, with the config's resources:; pip install scpdr[ray]).",
    ),
    address: str | None = typer.Option(
        None,
        "--address",
        help="Ray cluster to run on (with --executor ray; 'auto': the one on this machine; "
        "default: a local one started for the run). OUT must be on a filesystem every node sees.",
    ),
) -> None:
    """Run (or resume) an experiment and write results.json, report.md and report.html."""
    from scpdr.commands import check_out_dir
    from scpdr.experiment import load_config, make_executor

    load_config(config)  # validate first: errors name the key
    runner = make_executor(executor, address=address)  # Ray missing: an error before any work
    out_dir = out if out is not None else Path("runs") / config.stem
    check_out_dir(out_dir)
    if force or dry_run:
        from scpdr.experiment import planned

        cfg, stages, report = planned(config)  # once, for both
        if force:
            _check_force(config, [*stages, report], force)
        if dry_run:
            _print_plan(cfg, [*stages, report], out_dir, force=force)
            return
    run_and_print(
        config, out_dir, force=force, progress=progress, keep_stale=keep_stale, executor=runner
    )


def run_and_print(
    config: Path,
    out: Path,
    *,
    force: list[str],
    progress: bool,
    keep_stale: bool = False,
    executor: Executor | None = None,
):  # type: ignore[no-untyped-def]
    """Run ``config`` into ``out`` with ``executor`` (default: local) and print the main table
    (shared with ``scpdr demo``)."""
    import time

    from rich.console import Console

    from scpdr.experiment import run_experiment
    from scpdr.report import to_rich

    t0 = time.perf_counter()
    result = run_experiment(
        config, out, force=force, progress=progress, keep_stale=keep_stale, executor=executor
    )
    seconds = time.perf_counter() - t0
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(to_rich(result.main_table))
    for note in result.main_table.notes:
        console.print(f"[dim]{note}[/dim]")
    console.print(
        f"{len(result.ran)} stage(s) ran, {len(result.cached)} cached, {seconds:.0f} s. "
        f"Report: {result.report_md} and {result.report_html}; rows: {result.results_json}"
    )
    return result


def _check_force(config: Path, stages: Sequence[Stage], force: list[str]) -> None:
    """Every --force pattern must name at least one stage (a typo would silently re-run nothing)."""
    from scpdr.errors import ConfigError
    from scpdr.experiment import matches_stage

    unmatched = [p for p in force if not any(matches_stage(s, p) for s in stages)]
    if unmatched:
        kinds = sorted({n.split("/")[0] for s in stages for n in (s.name, s.label)})
        raise ConfigError(
            f"--force {', '.join(repr(p) for p in unmatched)} matches no stage of {config}; "
            f"use a stage name or glob such as {', '.join(kinds)} or 'attack/*' "
            "(`--dry-run` lists the stages)"
        )


def _print_plan(
    cfg: ExperimentConfig, stages: Sequence[Stage], out: Path, *, force: Sequence[str] = ()
) -> None:
    from rich.console import Console
    from rich.markup import escape as rich_escape

    from scpdr.experiment import StageRunner, matches_stage

    runner = StageRunner(out, cfg, progress=False)
    console = Console()
    seen = set()
    for s in stages:
        if s.key in seen:
            continue
        seen.add(s.key)
        if any(matches_stage(s, p) for p in force):
            status = "forced"
        else:
            status = "cached" if runner.is_done(s) else "to run"
        console.print(f"{status:>7}  {rich_escape(s.label)}  [dim]{s.hash[:16]}[/dim]")
