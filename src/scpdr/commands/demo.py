"""``scpdr demo``: ``scpdr experiment configs/demo.yaml --out runs/demo`` — names2ids with
canaries on the embedded SmolLM2-135M: No CP leaks the IDs, SCP-Δr-b does not. Prints the main
table, a verdict per method, the membership-inference table and the demo's checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Output directory."),
    config: Path | None = typer.Option(
        None, "--config", help="Config to run (default: configs/demo.yaml of this checkout)."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress display."),
) -> None:
    """Run the demo experiment (cached: a second run takes seconds) and print its main table."""
    from rich.console import Console

    from scpdr.commands import check_out_dir
    from scpdr.commands.experiment import run_and_print
    from scpdr.experiment import load_config

    path = config or demo_config_path()
    load_config(path)  # validate first: a missing file or a bad key is one line naming it
    check_out_dir(out)
    result = run_and_print(path, out, force=[], progress=progress)
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the tables into 80 columns
        console = Console(width=200)
    print_audit(console, result.rows)
    for line in demo_checks(result.rows):
        console.print(line)


def print_audit(console: Any, rows: list[dict[str, Any]]) -> None:
    """The verdict per method and the membership-inference table, under the main table."""
    from rich.markup import escape

    from scpdr.report import mia_table, to_rich, verdicts

    lines = verdicts(rows)
    if lines:
        console.print("[bold]Verdicts[/bold] (95% intervals; see docs/attacks.md)")
        for line in lines:
            console.print(f"  • {escape(line)}")
    table = mia_table(rows)
    if table is not None:
        console.print(to_rich(table))
        for note in table.notes:
            console.print(f"[dim]{escape(note)}[/dim]")


def demo_checks(rows: list[dict[str, Any]]) -> list[str]:
    """The demo's claims, checked on its rows: No CP extracts ≥ half of the IDs in full,
    SCP-Δr-b ≤ 5%, CP-Fuse's TTE AUC and ACC are within 0.05 of CP-ΔKL's (the TDE game's
    protocol: CP-Fuse is CP-ΔKL at a fresh request's first step, §5.3), and SCP-Δr-b's
    next-token accuracy is within 0.02 of No CP's."""
    from scpdr.methods import SPECS, canonical

    def value(method: str, attack: str, metrics: tuple[str, ...]) -> float | None:
        for r in rows:
            if (
                r.get("sweep") is None
                and r.get("method") == method
                and r.get("attack") == attack
                and r.get("metric") in metrics
                and r.get("value") is not None
            ):
                return float(r["value"])
        return None

    scp_b = canonical("scp-delta-r")  # SCP-Δr-b, the paper's method
    fer_none = value("none", "pii", ("fer",))
    fer_scp = value(scp_b, "pii", ("fer",))
    acc_none = value("none", "utility", ("accuracy", "acc"))
    acc_scp = value(scp_b, "utility", ("accuracy", "acc"))
    checks = []

    def line(ok: bool | None, text: str) -> str:
        mark = "[green]✓[/green]" if ok else ("[red]✗[/red]" if ok is False else "[dim]?[/dim]")
        return f"{mark} {text}"

    if fer_none is not None:
        checks.append(
            line(fer_none >= 0.5, f"No CP extracts {fer_none:.0%} of the IDs in full (≥ 50%)")
        )
    if fer_scp is not None:
        checks.append(line(fer_scp <= 0.05, f"SCP-Δr-b extracts {fer_scp:.0%} (≤ 5%)"))
    fuse, kl = (next(n for n, sp in SPECS.items() if sp.rule == r) for r in ("cp-fuse", "cp-kl"))
    tte = {m: [value(m, "tte", (x,)) for x in ("auc", "acc")] for m in (fuse, kl)}
    if all(v is not None for vals in tte.values() for v in vals):
        gap = max(abs(a - b) for a, b in zip(tte[fuse], tte[kl], strict=True))  # type: ignore[operator]
        checks.append(
            line(
                gap <= 0.05,
                f"CP-Fuse's TTE AUC/ACC {tte[fuse][0]:.2f}/{tte[fuse][1]:.2f} within 0.05 of "
                f"CP-ΔKL's {tte[kl][0]:.2f}/{tte[kl][1]:.2f} (each prefix a fresh request: §5.3)",
            )
        )
    if acc_none is not None and acc_scp is not None:
        d = acc_scp - acc_none
        checks.append(
            line(
                abs(d) <= 0.02,
                f"utility: next-token accuracy {acc_scp:.3f} vs No CP {acc_none:.3f} (within 0.02)",
            )
        )
    return checks


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
