"""``scpdr train``: partition a dataset, train one constituent per partition, write a bundle
(docs/training.md, docs/data.md). The training options are generated from
:class:`~scpdr.training.config.TrainConfig` (:data:`~scpdr.commands.options.TRAIN_OPTIONS`); the
field options (``--text-field``, ``--secrets-field``, ``--group-field``, ...) from
:class:`~scpdr.data.records.FieldMapping`. The plan of every constituent (records, tokens, steps,
lr schedule; sized to the data, :mod:`scpdr.training.plan`) is printed before training."""

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
    TRAIN_OPTIONS,
    VAL_FRACTION,
    build,
    canary_config,
    with_options,
)
from scpdr.device import DEVICE_HELP


def print_plans(
    pset: Any, base_ref: str, config: Any, device: str | None = None, resume: bool = False
) -> None:
    """Print each constituent's training plan (:func:`scpdr.training.fit_to_data`), with the
    precision it trains in on ``device`` (``None``: the default, as training resolves it) and
    why (:mod:`scpdr.training.precision`; decided by the main process, as in training).
    ``resume``: say that a resumed constituent keeps the batching its checkpoint started with
    (``finetune`` logs which), which may differ from the plan printed here."""
    from scpdr.models import load_tokenizer
    from scpdr.training import example_lengths, fit_to_data
    from scpdr.training.placement import main_result, training_device
    from scpdr.training.precision import resolve_precision

    tok = load_tokenizer(base_ref)
    if config.dp:  # DP runs size their own batches, in fp32 (training/dp.py)
        from scpdr.training.dp import DP_PRECISION

        choice, dev = DP_PRECISION, None
    else:
        dev = training_device(device)
        choice = main_result(lambda: resolve_precision(config.precision, device=dev))
    kept = " (a resumed constituent keeps the batching it started with)" if resume else ""
    typer.echo(f"training plan ({pset.k} constituents){kept}:")
    for i, part in enumerate(pset.parts):
        if part:
            _, plan = fit_to_data(
                config,
                example_lengths(part, tok),
                name=f"constituent-{i}",
                precision=choice,
                device=dev,
            )
            typer.echo(plan.summary())
            if config.dp:  # the privacy of the run: ε, δ, σ, q, steps (training/dp.py)
                from scpdr.training.dp import dp_plan

                typer.echo(dp_plan(config, n_records=len(part), steps=plan.total_steps).summary())


@with_options(TRAIN_OPTIONS, FIELD_OPTIONS, SECRET_OPTIONS, GROUPING_OPTIONS, CANARY_OPTIONS)
def train(
    *,
    data: str = typer.Option(
        ...,
        "--data",
        help="names2ids, pycode, pydocs, a .jsonl/.csv/.parquet file, a datasets dir, or a "
        "partition dir written by `scpdr partition`.",
    ),
    partitions: int | None = typer.Option(
        None,
        "--partitions",
        help="Number of partitions/constituents, at least 2 (default 4, or 2 when the data has "
        "fewer than 80 training records: 20 per partition; a partition dir DATA sets its own).",
    ),
    out: Path = typer.Option(..., "--out", help="Bundle directory to write."),
    base: str = typer.Option(
        "embedded",
        "--base",
        help="Base model: 'embedded' (SmolLM2-135M-Instruct), 'tiny' (random tiny model for "
        "smoke runs), or a model directory.",
    ),
    n_train: int | None = typer.Option(None, "--n-train", help="Training examples (all)."),
    n_val: int | None = typer.Option(
        None, "--n-val", help="Validation examples held out (instead of --val-fraction)."
    ),
    val_fraction: float | None = VAL_FRACTION,
    split: str | None = typer.Option(None, "--split", help="Split of a saved DatasetDict."),
    seed: int = typer.Option(0, "--seed", help="Seed for data, partitions and training."),
    canaries: str = CANARIES,
    config: Path | None = typer.Option(
        None,
        "--config",
        help="TrainConfig settings (.json or .yaml), or a finished run's train_info.json; the "
        "options override it.",
    ),
    allow_failed_audit: bool = typer.Option(
        False,
        "--allow-failed-audit",
        help="Bundle even if partitions overlap (recorded in the bundle's audit field).",
    ),
    method: str = typer.Option("scp-delta-r", "--method", help="Default method of the bundle."),
    m: int = typer.Option(10, "--m", min=1, help="Default smoothing parameter m of the bundle."),
    device: str | None = typer.Option(None, "--device", help=DEVICE_HELP),
    bf16: bool | None = typer.Option(
        None,
        "--bf16/--no-bf16",
        hidden=True,  # the former spelling of --precision bf16 / fp32, kept working
        help="Former spelling of --precision bf16 (--no-bf16: fp32).",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the interrupted run in --out (same data and options) from its last "
        "checkpoints; without it, an interrupted run there is an error.",
    ),
    train_options: dict[str, Any],
    field_options: dict[str, Any],
    secret_options: dict[str, Any],
    grouping_options: dict[str, Any],
    canary_options: dict[str, Any],
) -> None:
    """Train one constituent per partition of --data and write a bundle to --out.

    Secrets (--secrets-field, --secret-pattern) are stored with the partitions in the bundle
    and checked by the partition audit; --group-field keeps a data subject's records in one
    partition. `scpdr eval BUNDLE` measures them; `scpdr export` makes a bundle without them.
    An interrupted run continues with --resume.

    Each step costs what the data needs: unpacked records are batched by length and padded
    per batch (--no-group-by-length: random batches), the loss is computed in chunks of
    tokens (--no-chunked-loss: the model's own), and --precision auto trains in bf16 where
    the CPU has bf16 units and it measured faster. The plan printed first says how much
    of the batches is padding, and which precision and why.
    """
    from scpdr.commands import check_method
    from scpdr.data import load_partitions, prepare_partitions
    from scpdr.errors import ConfigError
    from scpdr.training import TrainConfig, train_bundle
    from scpdr.training.bundle import check_constituents
    from scpdr.training.placement import is_main_process, main_process_first, training_device
    from scpdr.training.resume import check_bundle_resume

    if bf16 is not None:  # --bf16 / --no-bf16: --precision bf16 / fp32
        old = "bf16" if bf16 else "fp32"
        given = getattr(train_options.get("precision"), "value", train_options.get("precision"))
        if given is not None and given != old:
            raise ConfigError(
                f"--{'' if bf16 else 'no-'}bf16 contradicts --precision {given}; drop "
                "--bf16 (the former spelling of --precision)"
            )
        train_options = {**train_options, "precision": old}
    if partitions is not None:  # before any data is read or model loaded
        check_constituents(partitions)
    check_bundle_resume(out, resume)
    saved = {}
    if config is not None:
        saved = TrainConfig.from_file(config).model_dump(exclude_unset=True)
    cfg = build(TRAIN_OPTIONS, {**saved, **train_options}, seed=seed)
    check_method(method)  # before training, not after it
    device = training_device(device)
    canary_cfg = canary_config(canaries, canary_options)

    data_path = Path(data)
    if data_path.is_dir() and (data_path / "manifest.json").is_file():
        pset = load_partitions(data_path)
        check_constituents(
            pset.k, fix=f"{data} holds {pset.k}; partition it again: `scpdr partition --k 2`"
        )
        given = [
            *(
                flag
                for flag, v in (("--n-train", n_train), ("--n-val", n_val), ("--split", split))
                if v is not None
            ),
            *(["--canaries"] if canary_cfg is not None else []),
            *(["--val-fraction"] if val_fraction is not None else []),
            *(SECRET_OPTIONS.flags_of(n)[0] for n in secret_options),
            *([f"--partitions {partitions}"] if partitions not in (None, pset.k) else []),
            *(FIELD_OPTIONS.flags_of(n)[0] for n in field_options),
            *(GROUPING_OPTIONS.flags_of(n)[0] for n in grouping_options),
            *(CANARY_OPTIONS.flags_of(n)[0] for n in canary_options),
        ]
        if given:
            raise ConfigError(
                f"{data} is a partition directory (already split in {pset.k} partitions), so "
                f"{', '.join(given)} would be ignored; drop them, or pass the raw data and let "
                "`scpdr train` partition it"
            )
        source: Any = pset
    else:
        from scpdr.data import ChatTemplate

        source = prepare_partitions(
            data,
            k=partitions,  # None: 4, or 2 for fewer than 80 records (data.default_k)
            seed=seed,
            n_train=n_train,
            n_val=n_val,
            val_fraction=val_fraction,  # None: the default carve (docs/data.md)
            fields=build(FIELD_OPTIONS, field_options),
            split=split,
            grouping=build(GROUPING_OPTIONS, grouping_options),
            canaries=canary_cfg,
            secrets=build(SECRET_OPTIONS, secret_options),
            # chat records: the base's chat template, the one the server's chat endpoint applies
            chat=ChatTemplate("embedded" if base in ("embedded", "tiny") else base),
            allow_failed_audit=allow_failed_audit,
            override="`--allow-failed-audit`",
        )
        pset = source.pset
        if source.k_reason is not None:
            typer.echo(source.k_reason)
        typer.echo(source.audit.summary())

    base_ref: str = base
    if base == "tiny":
        from scpdr.tiny import tiny_model, tiny_tokenizer

        tiny_dir = out / "base"
        with main_process_first():  # under accelerate launch: written once, read by all
            if not (tiny_dir / "config.json").is_file():
                tiny_model(seed).save_pretrained(str(tiny_dir))
                tiny_tokenizer().save_pretrained(str(tiny_dir))
        base_ref = str(tiny_dir)
    print_plans(pset, base_ref, cfg, device, resume=resume)
    path = train_bundle(
        source,
        base=base_ref,
        config=cfg,
        out=out,
        allow_failed_audit=allow_failed_audit,
        method=method,
        m=m,
        device=device,
        resume=resume,
    )
    if is_main_process():
        typer.echo(f"wrote bundle {path} with {pset.k} constituents")
