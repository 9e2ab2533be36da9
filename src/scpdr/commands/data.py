"""``scpdr partition DATA --k K --out DIR`` and ``scpdr audit-partitions DIR`` (docs/data.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from scpdr.commands.options import (
    CANARIES,
    CANARY_OPTIONS,
    FIELD_OPTIONS,
    GROUPING_OPTIONS,
    SECRET_OPTIONS,
    VAL_FRACTION,
    build,
    canary_config,
    with_options,
)


def _parse_fields(fields: list[str] | None) -> dict[str, str]:
    from scpdr.errors import ConfigError

    out = {}
    for item in fields or []:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours or not theirs:
            raise ConfigError(f"--field expects OURS=THEIRS (e.g. prompt=question), got {item!r}")
        out[ours.strip()] = theirs.strip()
    return out


@with_options(FIELD_OPTIONS, SECRET_OPTIONS, GROUPING_OPTIONS, CANARY_OPTIONS)
def partition(
    *,
    data: str = typer.Argument(
        ...,
        help="Built-in corpus (names2ids, pycode, pydocs), a .jsonl/.csv/.parquet file or a "
        "datasets dir.",
    ),
    k: int | None = typer.Option(
        None,
        "--k",
        help="Number of disjoint partitions (= constituents), >= 2 (default 4, or 2 when the "
        "data has fewer than 80 training records: 20 per partition).",
    ),
    out: Path = typer.Option(..., "--out", help="Output directory (must not exist)."),
    n_train: int | None = typer.Option(None, "--n-train", help="Training examples (all)."),
    n_val: int | None = typer.Option(
        None, "--n-val", help="Validation examples held out (instead of --val-fraction)."
    ),
    val_fraction: float | None = VAL_FRACTION,
    split: str | None = typer.Option(None, "--split", help="Split of a saved DatasetDict."),
    seed: int = typer.Option(0, "--seed", help="Seed for data generation and assignment."),
    canaries: str = CANARIES,
    field: list[str] | None = typer.Option(
        None,
        "--field",
        hidden=True,  # the older spelling of --prompt-field etc., kept working
        help="Field mapping OURS=THEIRS, e.g. --field prompt=question (repeat).",
    ),
    field_options: dict[str, Any],
    secret_options: dict[str, Any],
    grouping_options: dict[str, Any],
    canary_options: dict[str, Any],
) -> None:
    """Split DATA into --k disjoint partitions (near-duplicates and groups together), audit them.

    Writes --out DIR: manifest.json, partition-<i>.jsonl, validation.jsonl, canaries.json.
    """
    from scpdr.data import prepare_partitions
    from scpdr.errors import ConfigError
    from scpdr.training.bundle import check_constituents

    if k is not None:
        check_constituents(k, fix="use --k 2 or more")  # one partition trains nothing protectable
    if out.exists():  # before the (possibly long) grouping, and naming the CLI's fix
        raise ConfigError(f"--out {out} already exists; choose a new directory or remove it")
    legacy = _parse_fields(field)
    both = {f for f in legacy if f in field_options and legacy[f] != field_options[f]}
    if both:
        raise ConfigError(f"--field and --{sorted(both)[0]}-field disagree; pass one of them")
    prepared = prepare_partitions(
        data,
        k=k,
        seed=seed,
        n_train=n_train,
        n_val=n_val,
        val_fraction=val_fraction,  # None: the default carve (docs/data.md)
        fields=build(FIELD_OPTIONS, {**legacy, **field_options}),
        split=split,
        grouping=build(GROUPING_OPTIONS, grouping_options),
        canaries=canary_config(canaries, canary_options),
        secrets=build(SECRET_OPTIONS, secret_options),
        out=out,
        allow_failed_audit=True,  # written either way; the summary says FAILED
    )
    pset = prepared.pset
    if prepared.k_reason is not None:
        typer.echo(prepared.k_reason)
    sizes = ", ".join(str(len(p)) for p in pset.parts)
    typer.echo(
        f"wrote {out}: {pset.manifest.num_records} records in {pset.k} partitions ({sizes}), "
        f"{pset.manifest.num_groups} near-duplicate groups, {len(pset.validation)} validation"
    )
    typer.echo(prepared.audit.summary())


def audit_partitions(
    directory: Path = typer.Argument(..., help="Partition directory (scpdr partition --out)."),
    threshold: float | None = typer.Option(
        None, "--threshold", help="Near-duplicate Jaccard (default: the manifest's)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON."),
) -> None:
    """Check DIR's partitions for overlaps (exact, near-duplicate, declared secrets) with each
    other and with the validation records; exit 1 on any overlap."""
    from scpdr.data import audit_partitions as audit
    from scpdr.data import load_partitions
    from scpdr.io import atomic_write_json

    pset = load_partitions(directory)
    grouping = pset.manifest.grouping
    if threshold is not None:
        grouping = build(GROUPING_OPTIONS, {**grouping.model_dump(), "threshold": threshold})
    report = audit(
        pset.manifest,
        pset.records(),
        grouping=grouping,
        canaries=pset.canaries,
        validation=pset.validation,
    )
    if json_out is not None:
        atomic_write_json(json_out, report.to_dict())
    typer.echo(report.summary())
    if not report.passed:
        # SystemExit, not typer.Exit: click returns typer.Exit's code from a non-standalone call,
        # which scpdr.cli.main does not forward
        raise SystemExit(1)
