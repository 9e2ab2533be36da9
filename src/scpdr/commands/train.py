"""``scpdr train``: partition a dataset, train one constituent per partition, write a bundle
(docs/training.md)."""

from __future__ import annotations

from pathlib import Path

import typer


def train(
    data: str = typer.Option(
        ...,
        "--data",
        help="names2ids, pycode, pydocs, a .jsonl/.csv file, a dataset dir, or a partition dir "
        "written by `scpdr partition`.",
    ),
    partitions: int | None = typer.Option(
        None,
        "--partitions",
        min=1,
        help="Number of partitions/constituents (default 2; a partition dir DATA sets its own).",
    ),
    out: Path = typer.Option(..., "--out", help="Bundle directory to write."),
    base: str = typer.Option(
        "embedded",
        "--base",
        help="Base model: 'embedded' (SmolLM2-135M-Instruct), 'tiny' (random tiny model for "
        "smoke runs), or a model directory.",
    ),
    lora: bool = typer.Option(False, "--lora", help="LoRA instead of full fine-tuning."),
    epochs: float | None = typer.Option(None, "--epochs", help="Epochs (paper: 50 / LoRA 20)."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Stop after N steps."),
    lr: float | None = typer.Option(None, "--lr", help="Learning rate (paper: 5e-5 / 5e-4)."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Batch (paper: 1 / 64)."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Sequence length (paper: 2048)."),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="Warmup (paper: 50)."),
    packing: bool | None = typer.Option(
        None, "--packing/--no-packing", help="Concatenate examples (default: full FT only)."
    ),
    goldfish: bool = typer.Option(False, "--goldfish", help="Goldfish loss (Hans et al. 2024)."),
    n_train: int | None = typer.Option(None, "--n-train", help="Training examples (all)."),
    n_val: int | None = typer.Option(None, "--n-val", help="Validation examples."),
    seed: int = typer.Option(0, "--seed", help="Seed for data, partitions and training."),
    canaries: str = typer.Option(
        "", "--canaries", help="Canary repetitions, e.g. 1,3,10 (empty: none)."
    ),
    canaries_per_rep: int = typer.Option(
        10, "--canaries-per-rep", min=1, help="Canaries per repetition count."
    ),
    canary_partition: int = typer.Option(
        0, "--canary-partition", min=0, help="Partition for canaries."
    ),
    threshold: float = typer.Option(0.7, "--threshold", help="Near-duplicate Jaccard."),
    config: Path | None = typer.Option(
        None, "--config", help="TrainConfig JSON file; the options above override it."
    ),
    allow_failed_audit: bool = typer.Option(
        False,
        "--allow-failed-audit",
        help="Bundle even if partitions overlap (recorded in the bundle's audit field).",
    ),
    method: str = typer.Option("scp-delta-r", "--method", help="Default method of the bundle."),
    m: int = typer.Option(10, "--m", min=1, help="Default smoothing parameter m of the bundle."),
) -> None:
    """Train one constituent per partition of --data and write a bundle to --out."""
    from scpdr.commands import check_method, format_validation_error
    from scpdr.commands.data import _parse_reps
    from scpdr.data import (
        CanaryConfig,
        GroupingConfig,
        load_corpus,
        load_partitions,
        make_canaries,
        partition_records,
    )
    from scpdr.errors import ConfigError
    from scpdr.train import TrainConfig, train_bundle

    cfg_dict = {}
    if config is not None:
        cfg_dict = TrainConfig.from_json(config.read_text(encoding="utf-8")).model_dump(
            exclude_unset=True
        )
    overrides = {
        "lora": lora or cfg_dict.get("lora", False),
        "epochs": epochs,
        "max_steps": max_steps,
        "learning_rate": lr,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "warmup_steps": warmup_steps,
        "packing": packing,
        "seed": seed,
    }
    if goldfish:
        overrides["goldfish"] = True
    cfg_dict.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = TrainConfig.model_validate(cfg_dict)
    except ValueError as exc:
        msg = format_validation_error(exc) if hasattr(exc, "errors") else str(exc)
        raise ConfigError(f"invalid training options: {msg}") from None
    check_method(method)  # before training, not after it

    data_path = Path(data)
    if data_path.is_dir() and (data_path / "manifest.json").is_file():
        pset = load_partitions(data_path)
        ignored = [
            flag
            for flag, given in (
                ("--n-train", n_train is not None),
                ("--n-val", n_val is not None),
                ("--canaries", bool(canaries.strip())),
                (f"--partitions {partitions}", partitions not in (None, pset.k)),
            )
            if given
        ]
        if ignored:
            raise ConfigError(
                f"{data} is a partition directory (already split in {pset.k} partitions), so "
                f"{', '.join(ignored)} would be ignored; drop them, or pass the raw data and let "
                "`scpdr train` partition it"
            )
    else:
        corpus = load_corpus(data, n_train=n_train, n_val=n_val, seed=seed)
        reps = _parse_reps(canaries)
        registry = (
            make_canaries(
                CanaryConfig(
                    n_per_repetition=canaries_per_rep,
                    repetitions=reps,
                    partition=canary_partition,
                    seed=seed,
                )
            )
            if reps
            else None
        )
        pset = partition_records(
            corpus.train,
            k=partitions if partitions is not None else 2,
            seed=seed,
            grouping=GroupingConfig(threshold=threshold),
            canaries=registry,
            validation=corpus.validation,
            dataset={
                "name": corpus.name,
                **{k: v for k, v in corpus.meta.items() if k != "sources"},
            },
        )

    base_ref: str = base
    if base == "tiny":
        from scpdr.testing import tiny_model, tiny_tokenizer

        tiny_dir = out / "base"
        if not (tiny_dir / "config.json").is_file():
            tiny_model(seed).save_pretrained(str(tiny_dir))
            tiny_tokenizer().save_pretrained(str(tiny_dir))
        base_ref = str(tiny_dir)
    path = train_bundle(
        pset,
        base=base_ref,
        config=cfg,
        out=out,
        allow_failed_audit=allow_failed_audit,
        method=method,
        m=m,
    )
    typer.echo(f"wrote bundle {path} with {pset.k} constituents")
