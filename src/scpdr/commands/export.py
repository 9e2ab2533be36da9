"""``scpdr export BUNDLE --out DIR``: the serving-only copy of a bundle (docs/deployment.md).

DIR holds the base model reference (or its copy), the constituents, the method, m and the
certificates' parameters, with ``export.json`` listing the sha256 of every file; no training
data, declared secrets, canaries or partition texts (:func:`scpdr.export.export_bundle`).
``scpdr serve DIR`` serves it.
"""

from __future__ import annotations

from pathlib import Path

import typer


def export(
    bundle: Path = typer.Argument(..., help="Bundle directory written by `scpdr train`."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write (must not exist)."),
    method: str | None = typer.Option(
        None, "--method", help="Default method of the served bundle (default: the bundle's)."
    ),
    m: int | None = typer.Option(
        None, "--m", min=1, help="Default smoothing parameter m (default: the bundle's)."
    ),
) -> None:
    """Write a serving-only copy of BUNDLE: models, method, m, sha256 of every file; no data.

    Training texts, declared secrets, canaries and partitions stay behind. The constituents are
    still as sensitive as the data they were trained on: see docs/deployment.md.
    """
    from scpdr.commands import check_method
    from scpdr.export import EXPORT_MANIFEST, export_bundle

    if method is not None:
        check_method(method)
    path = export_bundle(bundle, out, method=method, m=m)
    typer.echo(f"wrote {path} (serving only; file hashes in {path / EXPORT_MANIFEST})")
    typer.echo(f"serve it with: scpdr serve {path}")
