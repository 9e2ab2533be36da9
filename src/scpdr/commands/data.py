"""``scpdr partition DATA --k K --out DIR`` and ``scpdr audit-partitions DIR`` (docs/data.md)."""

from __future__ import annotations

from pathlib import Path

import typer


def _parse_fields(fields: list[str] | None) -> dict[str, str]:
    from scpdr.errors import ConfigError

    out = {}
    for item in fields or []:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours or not theirs:
            raise ConfigError(f"--field expects OURS=THEIRS (e.g. prompt=question), got {item!r}")
        out[ours.strip()] = theirs.strip()
    return out


def _parse_reps(text: str) -> tuple[int, ...]:
    from scpdr.errors import ConfigError

    try:
        reps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--canaries expects repetitions like 1,3,10, got {text!r}") from None
    return reps


def partition(
    data: str = typer.Argument(
        ...,
        help="Built-in corpus (names2ids, pycode, pydocs) or a .jsonl/.csv file or dataset dir.",
    ),
    k: int = typer.Option(2, "--k", min=1, help="Number of disjoint partitions (= constituents)."),
    out: Path = typer.Option(..., "--out", help="Output directory (must not exist)."),
    n_train: int | None = typer.Option(None, "--n-train", help="Training examples (all)."),
    n_val: int | None = typer.Option(None, "--n-val", help="Validation examples held out."),
    seed: int = typer.Option(0, "--seed", help="Seed for data generation and assignment."),
    threshold: float = typer.Option(
        0.7, "--threshold", help="Jaccard (character 5-gram shingles) grouping near-duplicates."
    ),
    num_perm: int = typer.Option(128, "--num-perm", min=16, max=1024, help="MinHash permutations."),
    field: list[str] | None = typer.Option(
        None, "--field", help="Field mapping OURS=THEIRS, e.g. --field prompt=question (repeat)."
    ),
    split: str | None = typer.Option(None, "--split", help="Split of a saved DatasetDict."),
    canaries: str = typer.Option(
        "", "--canaries", help="Canary repetitions, e.g. 1,3,10 (empty: no canaries)."
    ),
    canaries_per_rep: int = typer.Option(
        10, "--canaries-per-rep", min=1, help="Canaries per repetition count (as many held out)."
    ),
    canary_partition: int = typer.Option(
        0, "--canary-partition", min=0, help="Partition that receives every canary copy."
    ),
) -> None:
    """Split DATA into --k disjoint partitions (near-duplicates together) and write --out DIR:
    manifest.json, partition-<i>.jsonl, validation.jsonl, canaries.json; then audit them."""
    from scpdr.data import (
        CanaryConfig,
        GroupingConfig,
        audit_partitions,
        load_corpus,
        make_canaries,
        partition_records,
        save_partitions,
    )
    from scpdr.errors import ConfigError

    if out.exists():  # before the (possibly long) grouping, and naming the CLI's fix
        raise ConfigError(f"--out {out} already exists; choose a new directory or remove it")
    corpus = load_corpus(
        data,
        n_train=n_train,
        n_val=n_val,
        seed=seed,
        fields=_parse_fields(field) or None,
        split=split,
    )
    registry = None
    reps = _parse_reps(canaries)
    if reps:
        registry = make_canaries(
            CanaryConfig(
                n_per_repetition=canaries_per_rep,
                repetitions=reps,
                partition=canary_partition,
                seed=seed,
            )
        )
    pset = partition_records(
        corpus.train,
        k=k,
        seed=seed,
        grouping=GroupingConfig(threshold=threshold, num_perm=num_perm),
        canaries=registry,
        validation=corpus.validation,
        dataset={
            "name": corpus.name,
            **{k_: v for k_, v in corpus.meta.items() if k_ != "sources"},
        },
    )
    save_partitions(out, pset)
    sizes = ", ".join(str(len(p)) for p in pset.parts)
    typer.echo(
        f"wrote {out}: {pset.manifest.num_records} records in {k} partitions ({sizes}), "
        f"{pset.manifest.num_groups} near-duplicate groups, {len(pset.validation)} validation"
    )
    typer.echo(audit_partitions(pset.manifest, pset.records(), canaries=registry).summary())


def audit_partitions(
    directory: Path = typer.Argument(..., help="Partition directory (scpdr partition --out)."),
    threshold: float | None = typer.Option(
        None, "--threshold", help="Near-duplicate Jaccard (default: the manifest's)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON."),
) -> None:
    """Check DIR's partitions for exact and near-duplicate overlaps; exit 1 on any overlap."""
    from scpdr.data import audit_partitions as audit
    from scpdr.data import load_partitions
    from scpdr.io import atomic_write_json

    pset = load_partitions(directory)
    grouping = pset.manifest.grouping
    if threshold is not None:
        grouping = type(grouping).model_validate({**grouping.model_dump(), "threshold": threshold})
    report = audit(pset.manifest, pset.records(), grouping=grouping, canaries=pset.canaries)
    if json_out is not None:
        atomic_write_json(json_out, report.to_dict())
    typer.echo(report.summary())
    if not report.passed:
        # SystemExit, not typer.Exit: click returns typer.Exit's code from a non-standalone call,
        # which scpdr.cli.main does not forward
        raise SystemExit(1)
