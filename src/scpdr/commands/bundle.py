"""``scpdr bundle OUT -c REF -c REF [--base REF] [--partitions DIR]``: write a bundle manifest over
existing models, auditing the partitions they were trained on."""

from __future__ import annotations

from pathlib import Path

import typer


def bundle(
    out: Path = typer.Argument(..., help="Bundle directory to write (created if missing)."),
    constituent: list[str] = typer.Option(
        ...,
        "--constituent",
        "-c",
        help="Constituent model ref (HF dir, PEFT adapter dir, .gguf); repeat once per partition.",
    ),
    base: str | None = typer.Option(
        "embedded",
        "--base",
        help="Base model ref for SCP ('embedded' = SmolLM2-135M-Instruct); '' for none.",
    ),
    method: str = typer.Option(
        "scp-delta-r",
        "--method",
        help="Default aggregation method (none, cp-delta, cp-kl, cp-delta-r, scp-delta-r, "
        "scp-delta, cp-fuse): what `scpdr serve` runs without --method.",
    ),
    m: int = typer.Option(
        10, "--m", min=1, help="Default smoothing parameter m (Alg. 1; `scpdr serve` without --m)."
    ),
    held_out: Path | None = typer.Option(
        None,
        "--held-out",
        help="Text file, one held-out prompt per line (the paper uses 100): stores the constant "
        "base vector (mean base logits) for the 'c' variant.",
    ),
    partitions: Path | None = typer.Option(
        None,
        "--partitions",
        help="Partition directory the constituents were trained on (from `scpdr partition`, or "
        "a bundle's partitions/): audited before bundling (a failing audit refuses); the "
        "manifest hash and the audit are recorded in the bundle. Constituent i is partition i.",
    ),
    allow_failed_audit: bool = typer.Option(
        False,
        "--allow-failed-audit",
        help="With --partitions: bundle even if the audit fails (recorded as audit.overridden).",
    ),
    partition_manifest_hash: str | None = typer.Option(
        None,
        "--partition-manifest-hash",
        help="Hash of the partition manifest, when known (no audit; prefer --partitions, which "
        "computes it and must agree with it if both are given).",
    ),
) -> None:
    """Bundle a base model and K constituents (checked to share one vocabulary) into OUT.

    With --partitions DIR the partitions are audited first (as `scpdr train` does): overlaps
    between partitions stop the command unless --allow-failed-audit.
    """
    import logging

    from scpdr import models
    from scpdr.commands import check_method

    check_method(method)
    audit = None
    if partitions is not None:
        from scpdr.data import audit_for_bundle, load_partitions

        pset = load_partitions(partitions)
        if len(constituent) != pset.k:
            raise typer.BadParameter(
                f"{len(constituent)} constituents but {partitions} holds {pset.k} partitions; "
                f"pass one --constituent per partition, in partition order"
            )
        digest = pset.manifest.sha256()
        if partition_manifest_hash is not None and partition_manifest_hash != digest:
            raise typer.BadParameter(
                f"--partition-manifest-hash {partition_manifest_hash} disagrees with the hash of "
                f"{partitions} ({digest}); drop --partition-manifest-hash or pass the partitions "
                f"the constituents were trained on"
            )
        audit = audit_for_bundle(pset, allow_failed_audit=allow_failed_audit)
        partition_manifest_hash = digest
    elif allow_failed_audit:
        raise typer.BadParameter("--allow-failed-audit needs --partitions (the audit to override)")

    base_ref = base or None
    vec = None
    if held_out is not None:
        if base_ref is None:
            raise typer.BadParameter(
                "--held-out needs --base (the vector is the base's mean logits)"
            )
        prompts = [ln.strip() for ln in held_out.read_text(encoding="utf-8").splitlines()]
        prompts = [p for p in prompts if p]
        if not prompts:
            raise typer.BadParameter(f"{held_out} holds no prompts")
        model = models.load_model(base_ref)
        tok = models.load_tokenizer(base_ref)
        vec = models.constant_base_vector(model, tok, prompts)
    path = models.write_bundle(
        out,
        base=base_ref,
        constituents=constituent,
        method=method,
        m=m,
        partition_manifest_hash=partition_manifest_hash,
        audit=audit,
        constant_base=vec,
    )
    logging.getLogger(__name__).info("wrote bundle %s", path / models.BUNDLE_MANIFEST)
    typer.echo(str(path))
