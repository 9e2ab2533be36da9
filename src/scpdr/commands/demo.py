"""``scpdr demo``: ``scpdr experiment configs/demo.yaml --out runs/demo`` — names2ids with
canaries on the embedded SmolLM2-135M: No CP leaks the IDs, SCP-Δr-b does not."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Output directory."),
    config: Path | None = typer.Option(
        None, "--config", help="Config to run (default: configs/demo.yaml of this checkout)."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress display."),
) -> None:
    """Run the demo experiment (cached: a second run takes seconds) and print its main table."""
    from scpdr.commands.experiment import run_and_print

    run_and_print(config or demo_config_path(), out, force=[], progress=progress)


def demo_config_path() -> Path:
    """``configs/demo.yaml``: in the current directory, else in the checkout scpdr runs from."""
    import scpdr
    from scpdr.errors import ConfigError

    candidates = [
        Path.cwd() / "configs" / "demo.yaml",
        Path(scpdr.__file__).resolve().parents[2] / "configs" / "demo.yaml",
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(
        "configs/demo.yaml not found (looked in "
        + ", ".join(str(c.parent) for c in candidates)
        + "); run from the scpdr checkout or pass --config PATH"
    )
