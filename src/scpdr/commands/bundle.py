"""``scpdr bundle OUT -c REF -c REF [--base REF]``: write a bundle manifest over existing models."""

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
    method: str = typer.Option("scp-delta-r", "--method", help="Default aggregation method."),
    m: int = typer.Option(10, "--m", help="Default smoothing parameter m (Alg. 1)."),
    held_out: Path | None = typer.Option(
        None,
        "--held-out",
        help="Text file, one held-out prompt per line (the paper uses 100): stores the constant "
        "base vector (mean base logits) for the 'c' variant.",
    ),
    partition_manifest_hash: str | None = typer.Option(
        None, "--partition-manifest-hash", help="Hash of the partition manifest, when known."
    ),
) -> None:
    """Bundle a base model and K constituents (checked to share one vocabulary) into OUT."""
    import logging

    from scpdr import models

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
        constant_base=vec,
    )
    logging.getLogger(__name__).info("wrote bundle %s", path / models.BUNDLE_MANIFEST)
    typer.echo(str(path))
