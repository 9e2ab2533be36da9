"""``scpdr forget B --ids ID... | --group VALUE... | --secret-matching REGEX --out B2``: honour a
deletion request by training again only the constituents whose partition held the records
(:func:`scpdr.training.forget.forget_records`), and ``scpdr eval B2 --forgotten``'s part: the
attacks on the forgotten records before and after (:func:`scpdr.attacks.forgotten.eval_forgotten`),
printed side by side with their 95% intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from scpdr.device import DEVICE_HELP

#: The metrics printed per attack (every row, TPR@1% included, is in results.json).
_SHOWN = {
    "pii": ("fer", "ael"),
    "secrets": ("fer", "extracted"),
    "mia": ("auc",),
}
#: The membership tests whose "after" row should match the validation row.
_CHECKED_MIA = ("ref", "lira")


def forget(
    bundle: Path = typer.Argument(..., help="Bundle directory written by `scpdr train`."),
    out: Path = typer.Option(..., "--out", "-o", help="New bundle to write (must not exist)."),
    ids: list[str] | None = typer.Option(
        None,
        "--ids",
        metavar="ID",
        help="Record ids to forget (repeat the option, or separate ids by commas); the ids of "
        "BUNDLE/partitions/manifest.json.",
    ),
    ids_file: Path | None = typer.Option(
        None, "--ids-file", help="A file of record ids to forget, one per line."
    ),
    group: list[str] | None = typer.Option(
        None,
        "--group",
        metavar="VALUE",
        help="Forget every record of this data subject (a --group-field value; repeat the "
        "option for several).",
    ),
    secret_matching: str | None = typer.Option(
        None,
        "--secret-matching",
        metavar="REGEX",
        help="Forget every record that declares a secret matching this regular expression "
        "(re.search; ^...$ for whole secrets), and every record whose text contains one.",
    ),
    allow_failed_audit: bool = typer.Option(
        False,
        "--allow-failed-audit",
        help="Write the bundle even if the audit of the new partitions fails (recorded).",
    ),
    device: str | None = typer.Option(None, "--device", help=DEVICE_HELP),
) -> None:
    """Forget records: retrain only the constituents that saw them, copy the others unchanged.

    Every other record stays in its partition; the retrained constituents use the settings
    and seed they were trained with. OUT's scpdr.json logs the deletion (when, how many, which
    partitions; ids salted and hashed). OUT/forgotten/ keeps the removed records for
    `scpdr eval OUT --forgotten --out DIR` (never exported): delete it, and BUNDLE, after that
    check. An interrupted run continues when the same command runs again.
    """
    from scpdr.errors import ConfigError
    from scpdr.training.forget import forget_records

    wanted = [i.strip() for v in ids or [] for i in v.split(",") if i.strip()]
    if ids_file is not None:
        lines = ids_file.read_text(encoding="utf-8").splitlines()
        wanted += [ln.strip() for ln in lines if ln.strip()]
        if not wanted:
            raise ConfigError(f"--ids-file {ids_file} lists no id")
    result = forget_records(
        bundle,
        ids=wanted or None,
        groups=group or None,
        secret_matching=secret_matching,
        out=out,
        device=device,
        allow_failed_audit=allow_failed_audit,
    )
    typer.echo(result.summary())
    typer.echo(f"check it: scpdr eval {out} --forgotten --out {out}-forgotten-eval")


def eval_forgotten_command(
    bundle: Path,
    *,
    out: Path,
    before: Path | None,
    attacks: str | None,
    methods: str | None,
    options: Any,
    device: str | None,
    dtype: Any = None,
) -> None:
    """``scpdr eval B2 --forgotten``: the rows, DIR/results.json, and the verdict lines
    (``dtype``: the models', from ``--precision``)."""
    from rich.console import Console

    from scpdr.attacks.forgotten import FORGOTTEN_ATTACKS, eval_forgotten
    from scpdr.attacks.results import save_results
    from scpdr.commands import split_list

    attack_list = (
        split_list(attacks, "--attacks", ", ".join(FORGOTTEN_ATTACKS))
        if attacks is not None
        else list(FORGOTTEN_ATTACKS)
    )
    method_list = split_list(methods, "--methods", "methods") if methods is not None else None
    rows = eval_forgotten(
        bundle,
        before=before,
        methods=method_list,
        attacks=attack_list,
        options=options,
        device=device,
        dtype=dtype,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_results(rows, out / "results.json")
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(forgotten_table(rows))
    for line in forgotten_verdicts(rows):
        console.print(line, soft_wrap=True)
    typer.echo(str(out / "results.json"))


def _cell(row: Any) -> str:
    if row is None:
        return "–"
    lo, hi = row.extra.get("ci_low"), row.extra.get("ci_high")
    ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
    return f"{row.value:.2f}{ci} (n={row.n})"


def forgotten_table(rows: list[Any]) -> Any:
    """A rich table: per partition, method, attack and metric, the value before and after the
    deletion with its 95% interval and n."""
    from rich.table import Table

    from scpdr.methods import SPECS

    table = Table(title="Forgotten records: before → after the deletion (95% intervals)")
    for col in ("partition", "method", "attack", "metric", "before", "after"):
        table.add_column(col)
    keyed: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        family = "mia" if r.extra.get("n_members") is not None else r.attack
        if r.metric not in _SHOWN.get(family, ()):
            continue
        key = (r.extra.get("partition"), r.method, r.attack, r.metric)
        keyed.setdefault(key, {})[r.extra.get("bundle")] = r
    for (p, method, attack, metric), by in keyed.items():
        label = SPECS[method].label if method in SPECS else method
        table.add_row(
            str(p), label, attack, metric, _cell(by.get("before")), _cell(by.get("after"))
        )
    return table


def forgotten_verdicts(rows: list[Any]) -> list[str]:
    """One line per check: extraction by No CP before and after (FER), and, after, each of Ref
    and LiRA against the validation row (the same test on records no model saw)."""
    from scpdr.attacks.results import NO_CP_VAL
    from scpdr.attacks.stats import Estimate, distinguishable

    def find(bundle: str, method: str, attack: str, metric: str, p: Any) -> Any:
        return next(
            (
                r
                for r in rows
                if r.extra.get("bundle") == bundle
                and r.method == method
                and r.attack == attack
                and r.metric == metric
                and r.extra.get("partition") == p
            ),
            None,
        )

    def est(r: Any) -> Estimate:
        nan = float("nan")
        lo, hi = r.extra.get("ci_low"), r.extra.get("ci_high")
        return Estimate(r.value, nan if lo is None else lo, nan if hi is None else hi, r.n)

    lines = []
    for p in sorted({r.extra.get("partition") for r in rows}):
        for attack in ("pii", "secrets"):
            b, a = (find(x, "none", attack, "fer", p) for x in ("before", "after"))
            if a is not None:
                ok = a.value == 0.0
                mark = "[green]✓[/green]" if ok else "[red]✗[/red]"
                lines.append(
                    f"{mark} partition {p}, {attack}: No CP extracts {a.value:.0%} of the "
                    f"forgotten records' {'IDs' if attack == 'pii' else 'secrets'} in full after "
                    f"(FER {_cell(a)}), {b.value if b else float('nan'):.0%} before"
                    + (f" (FER {_cell(b)})" if b else "")
                )
        for attack in _CHECKED_MIA:
            a, v = (find("after", m, attack, "auc", p) for m in ("none", NO_CP_VAL))
            if a is None or v is None:
                continue
            differs = distinguishable(est(a), est(v))
            mark = {False: "[green]✓[/green]", True: "[red]✗[/red]"}.get(differs, "[dim]?[/dim]")
            what = {False: "not distinguishable from", True: "distinguishable from"}.get(
                differs, "not comparable with"
            )
            lines.append(
                f"{mark} partition {p}, {attack} after: AUC {_cell(a)} on the forgotten records, "
                f"{what} the validation row {_cell(v)}"
            )
    return lines
