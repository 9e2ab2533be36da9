"""``scpdr eval BUNDLE --out DIR``: run attacks on a bundle's methods and say what they mean.

Writes ``DIR/results.json`` (result rows ``{"method", "attack", "metric", "value", ...}``),
``DIR/risk.jsonl`` (one line per secret-bearing training record and method, most at risk under
No CP first: :mod:`scpdr.attacks.risk`), ``DIR/report.md`` (the tables and paragraphs printed),
``DIR/timings.json`` (wall time per method and attack) and, with LiRA, ``DIR/lira_roc.png`` and
``DIR/roc.json``. It prints the main table, the membership-inference table (every test of the
suite, the No CP-val row, and what the number of non-members can resolve), the records most at
risk (with each record's chance level), the m sweep (``--m 1,3,10,30``) and one plain-language
paragraph per method. The data (target partition,
validation set, canaries, declared secrets) comes from ``--data`` (a partition directory written
by ``scpdr partition``/``scpdr train``) or from the bundle's manifest (``extra.partitions``).

With no options the attacks are sized for a CPU run of minutes (:func:`auto_options`), and the
methods are the main table's when that fits (a GPU, or little data), else No CP and SCP-Δr-b.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from scpdr.device import DEVICE_HELP, is_cuda, resolve_device
from scpdr.methods import MAIN_TABLE_METHODS, SPECS, STATELESS_RULES

_DEFAULT_METHODS = ",".join(MAIN_TABLE_METHODS)
_KNOWN_METHODS = ", ".join(n for n, s in SPECS.items() if s.kind == "aggregate")
_DEFAULT_ATTACKS = "canary,pii,tte,mia,utility,secrets"
#: The methods of a CPU run whose main table would not fit the budget: No CP (the undefended
#: constituent 0) and SCP-Δr-b (the paper's method).
CPU_METHODS: tuple[str, ...] = (
    MAIN_TABLE_METHODS[0],
    next(n for n, s in SPECS.items() if s.rule == "scp-delta-r" and s.base == "model"),
)
#: Token positions (model forwards x tokens) an automatic CPU evaluation may spend on the whole
#: main table (~4 min on 2 cores with the 135M base); above it the methods are CPU_METHODS.
CPU_TOKEN_BUDGET = 150_000
#: Example counts of an automatic evaluation (``None``: all): (tte, lira, utility).
AUTO_SIZES = {"tte_n": 32, "lira_n": 64, "utility_n": 64}


def _models(method: str) -> int:
    """The cost of a method's scorer per token, in model forwards (K = 2 constituents, + the
    base for '-b'; CP-Fuse's stateful fusion measured ~10x that of the stateless rules)."""
    spec = SPECS[method]
    if spec.rule == "none":
        return 1
    if spec.rule not in STATELESS_RULES:
        return 20
    return 3 if spec.base == "model" else 2


def auto_methods(eval_data: Any, *, device: str | None = None) -> list[str]:
    """The main table's methods when a GPU is there or the data is small (the estimated token
    positions of the whole table within :data:`CPU_TOKEN_BUDGET`), else :data:`CPU_METHODS`."""
    if is_cuda(device if device is not None else resolve_device(None)):
        return list(MAIN_TABLE_METHODS)
    n = AUTO_SIZES
    texts = [t.text for t in eval_data.secrets] + eval_data.train[: n["tte_n"]]
    texts += eval_data.validation[: n["utility_n"] + n["tte_n"]]
    texts += [str(getattr(r, "text", r)) for r in (eval_data.members or [])[: n["lira_n"]]]
    tokens = sum(len(t) for t in texts) // 4  # ~4 characters a token
    work = tokens * sum(_models(m) + 1 for m in MAIN_TABLE_METHODS)  # + LiRA's reference
    return list(MAIN_TABLE_METHODS) if work <= CPU_TOKEN_BUDGET else list(CPU_METHODS)


def parse_ms(text: str | None) -> list[int] | None:
    """``--m``: one smoothing level or a comma-separated sweep (``1,3,10,30``)."""
    from scpdr.errors import ConfigError

    if text is None:
        return None
    try:
        ms = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ConfigError(
            f"--m expects an integer or a list like 1,3,10,30, got {text!r}"
        ) from None
    if not ms or min(ms) < 1:
        raise ConfigError(f"--m values must be integers >= 1, got {text!r}")
    return ms


def eval_(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for results.json."),
    attacks: str = typer.Option(
        _DEFAULT_ATTACKS,
        "--attacks",
        help="Comma-separated: canary, pii, tte, mia (the membership-inference suite; lira is "
        "its older name), utility, secrets (those without their data are skipped).",
    ),
    methods: str | None = typer.Option(
        None,
        "--methods",
        help=f"Comma-separated result-row methods: {_KNOWN_METHODS} (scpdr.methods; "
        "scp-delta-r = scp-delta-r-b). Default: the main table's when it fits (GPU or little "
        "data), else none,scp-delta-r-b.",
    ),
    data: Path | None = typer.Option(
        None, "--data", help="Partition directory (default: the bundle's extra.partitions)."
    ),
    corpus: str | None = typer.Option(None, "--corpus", help="Corpus name in the result rows."),
    target: int | None = typer.Option(
        None,
        "--target",
        min=0,
        help="Attacked partition (default: the canaries' partition, else 0).",
    ),
    reference: str | None = typer.Option(
        None,
        "--reference",
        help="Model ref of p0 (trained without the LiRA members) for LiRA's reference CP(p0, q); "
        "default: q alone (constituent 1).",
    ),
    members: Path | None = typer.Option(
        None, "--members", help="JSONL/CSV records: LiRA members (default: the target partition)."
    ),
    m: str | None = typer.Option(
        None,
        "--m",
        help="Smoothing parameter m (default: the bundle's), or a sweep: --m 1,3,10,30 runs the "
        "smoothed methods at each m (the main table uses the bundle's m, else the first).",
    ),
    n_reference: int = typer.Option(
        10_000,
        "--n-reference",
        min=1,
        help="Random canary candidates for the exposure extrapolation.",
    ),
    pii_n: int | None = typer.Option(None, "--pii-n", min=1, help="Names attacked (default: all)."),
    tte_n: int | None = typer.Option(
        None, "--tte-n", min=1, help="Training examples for TTE [default: 32]."
    ),
    q_fails: bool = typer.Option(
        False, "--q-fails", help="Also TTE restricted to tokens q (constituent 1) fails to predict."
    ),
    lira_n: int | None = typer.Option(
        None,
        "--lira-n",
        min=1,
        help="Members and non-members each of the MIA suite (LiRA included) [default: 64].",
    ),
    utility_n: int | None = typer.Option(
        None, "--utility-n", min=1, help="Validation examples [default: 64]."
    ),
    secrets_n: int | None = typer.Option(
        None, "--secrets-n", min=1, help="Secrets attacked (default: all of the partition)."
    ),
    max_tokens: int = typer.Option(
        256, "--max-tokens", min=1, help="Tokens per example (TTE, LiRA, utility, ref)."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Sequences per scoring batch."),
    seed: int = typer.Option(0, "--seed", help="Seed of the canary reference sample."),
    device: str | None = typer.Option(None, "--device", help=DEVICE_HELP),
    precision: str = typer.Option(
        "auto",
        "--precision",
        help="Weights of the models attacked: fp32, bf16, or auto (what `scpdr serve "
        "--precision auto` serves on this machine: bf16 on CUDA; on CPU bf16 where the CPU has "
        "bf16 units and a first-use micro-benchmark finds them faster, else fp32).",
    ),
    budgets: str | None = typer.Option(
        None,
        "--budgets",
        help="Budget sweep on this bundle: response budgets in nats (e.g. 2,5,10,inf); prints "
        "the setting to deploy (docs/accountant.md).",
    ),
    on_budget: str = typer.Option(
        "stop", "--on-budget", help="With --budgets: 'base' sweeps the fallback too, beside stop."
    ),
    anchor: str | None = typer.Option(
        None, "--anchor", help="Budget sweep: anchored serving at these radii (nats per token)."
    ),
    forgotten: bool = typer.Option(
        False,
        "--forgotten",
        help="Attack the records BUNDLE forgot (`scpdr forget`; pii, secrets, mia) in the bundle "
        "before and in BUNDLE, and print both rows.",
    ),
    before: Path | None = typer.Option(
        None,
        "--before",
        help="With --forgotten: the bundle before the deletion (default: the one its deletion "
        "log names).",
    ),
) -> None:
    """Run attacks against the methods of a bundle, print what they mean, write DIR/results.json.

    Prints the main table, the membership-inference table (with its No CP-val row and what the
    number of non-members can resolve), the records most at risk with their chance level
    (DIR/risk.jsonl), the m sweep and one paragraph per method on what its certificate covers.
    """
    import logging
    from dataclasses import replace

    from scpdr.attacks.evaluation import (
        ATTACKS,
        BUNDLE_METHODS,
        EvalData,
        EvalOptions,
        ModelStore,
        bundle_data_dir,
        check_attacks,
        load_scorers,
        missing_data,
        run_eval,
    )
    from scpdr.commands import check_m, check_out_dir, split_list
    from scpdr.errors import ConfigError
    from scpdr.methods import resolve
    from scpdr.models import read_bundle

    log = logging.getLogger(__name__)
    check_out_dir(out)
    if before is not None and not forgotten:
        raise ConfigError("--before goes with --forgotten (the bundle before the deletion)")
    device = resolve_device(device)  # a bad or missing device fails before any work
    dtype = _model_dtype(precision, device, bundle)
    if forgotten:  # the forgotten records, before and after (scpdr.attacks.forgotten)
        from scpdr.commands.forget import eval_forgotten_command

        forgotten_options = EvalOptions(
            batch_size=batch_size, lira_max_tokens=max_tokens, seed=seed, pii_val_n=pii_n
        )
        eval_forgotten_command(
            bundle,
            out=out,
            before=before,
            attacks=None if attacks == _DEFAULT_ATTACKS else attacks,
            methods=methods,
            options=forgotten_options,
            device=device,
            dtype=dtype,
        )
        return
    attack_list = split_list(attacks, "--attacks", ", ".join(ATTACKS))
    from scpdr.commands.eval_budget import parse_values, run_budget_eval

    budget_grid = parse_values(budgets, "--budgets", allow_inf=True)
    anchor_grid = [float(c) for c in parse_values(anchor, "--anchor", allow_inf=False) if c]
    sweep_budget = bool(budget_grid or anchor_grid)
    if sweep_budget and "mia" not in attack_list:  # the No CP-val rows the verdict reads
        attack_list.append("mia")
    check_attacks(attack_list)  # before any model is loaded
    method_list = None
    if methods is not None:
        method_list = split_list(methods, "--methods", _DEFAULT_METHODS.replace(",", ", "))
        # result-row names (an alias names its row), checked before any model loads
        method_list = list(
            dict.fromkeys(resolve(n, allowed=BUNDLE_METHODS).name for n in method_list)
        )
    manifest = read_bundle(bundle)
    ms = parse_ms(m)
    for value in ms or []:
        check_m(value, manifest.vocab_size)
    data = bundle_data_dir(bundle, manifest, data)
    dataset_name = (manifest.extra.get("dataset") or {}).get("name")
    eval_data = EvalData.from_partitions(data, target=target, corpus=corpus or dataset_name)
    if members is not None:
        from scpdr.data import load_records

        eval_data.members = list(load_records(members))  # prompted: the response given the prompt
    if method_list is None:
        method_list = auto_methods(eval_data, device=device)
        if len(method_list) < len(MAIN_TABLE_METHODS):
            log.info(
                "methods %s: the main table's %d methods would take too long on this CPU; "
                "pass --methods %s for all of them",
                ",".join(method_list),
                len(MAIN_TABLE_METHODS),
                _DEFAULT_METHODS,
            )
        lacks = {"model": manifest.base is None, "constant": manifest.constant_base is None}
        dropped = [n for n in method_list if lacks.get(SPECS[n].base or "", False)]
        if dropped:
            log.warning(
                "bundle %s lacks what %s need (a base model for '-b', a constant base vector for "
                "'-c': `scpdr bundle --base/--held-out`); the default methods skip them",
                bundle,
                ", ".join(dropped),
            )
            method_list = [n for n in method_list if n not in dropped]
    sizes = {"tte_n": tte_n, "lira_n": lira_n, "utility_n": utility_n}
    sizes = {k: (AUTO_SIZES[k] if v is None else v) for k, v in sizes.items()}
    options = EvalOptions(
        n_reference=n_reference,
        batch_size=batch_size,
        pii_n=pii_n,
        pii_val_n=pii_n,
        tte_max_tokens=max_tokens,
        tte_q_fails=q_fails,
        lira_max_tokens=max_tokens,
        utility_max_tokens=max_tokens,
        secrets_n=secrets_n,
        secrets_val_n=secrets_n,
        seed=seed,
        **sizes,
    )
    quiet = attacks == _DEFAULT_ATTACKS  # the default list: canary/pii often have no data
    _check_data(
        eval_data, attack_list, options, data, missing_data, ATTACKS, ConfigError, log, quiet
    )
    main_m = manifest.m if ms is None else (manifest.m if manifest.m in ms else ms[0])
    store = ModelStore()  # every model loads once, whatever the m
    scorers = load_scorers(
        bundle, method_list, m=main_m, reference=reference, store=store, device=device, dtype=dtype
    )
    report = run_eval(scorers, eval_data, attack_list, options=options)
    sweeping = ms is not None and len(ms) > 1
    rows = _tag_m(report.rows, main_m, sweep=False) if sweeping else list(report.rows)
    timings = list(report.timings)
    smoothed = [n for n in method_list if SPECS[n].smoothed]
    for value in [v for v in ms or [] if v != main_m]:
        if not smoothed:
            log.warning("--m %d: none of the methods is smoothed; nothing to sweep", value)
            break
        sweep = load_scorers(
            bundle, smoothed, m=value, reference=reference, store=store, device=device, dtype=dtype
        )
        # the secrets' chance level does not depend on m: measured once, in the main run
        point_options = replace(options, secrets_counterfactual=False)
        point = run_eval(sweep, eval_data, attack_list, options=point_options)
        rows += _tag_m([r for r in point.rows if r.method in smoothed], value, sweep=True)
        timings += [{**t, "m": value} for t in point.timings]
    tables, closing = [], []
    if sweep_budget:
        rows += run_budget_eval(
            scorers,
            eval_data,
            method_list,
            budgets=budget_grid,
            on_budget=on_budget,
            anchors=anchor_grid,
            batch_size=batch_size,
            max_tokens=max_tokens,
            mia_n=sizes["lira_n"],
            seed=seed,
        )
        from scpdr.report.budget import budget_table
        from scpdr.report.recommend import recommend, recommendation_line

        table = budget_table([r.to_dict() for r in rows])
        tables = [table] if table is not None else []
        # the operating point: one line, after the tables (console and report.md)
        closing = [recommendation_line(recommend([r.to_dict() for r in rows]), str(bundle))]
    if not rows:  # e.g. LiRA alone without a reference model
        raise ConfigError(
            f"no result rows: every attack of --attacks {','.join(attack_list)} was skipped "
            "(the log says why); nothing was written"
        )
    _write_and_print(
        out, rows, timings, report, eval_data, method_list, main_m, ms,
        extra_tables=tables, closing=closing,
    )  # fmt: skip


def _model_dtype(precision: str, device: str, bundle: str | os.PathLike[str]) -> Any:
    """``--precision`` as the dtype the models load in (:func:`scpdr.serve.precision.decode_dtype`
    for how ``bundle`` decodes with its own method: the models ``scpdr serve`` would serve
    here), after checking the value."""
    from scpdr.errors import ConfigError
    from scpdr.serve.config import PRECISIONS
    from scpdr.serve.precision import decode_dtype, decode_form

    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    form = decode_form(bundle) if precision == "auto" else None
    return decode_dtype(precision, device, form=form)


def _check_data(
    eval_data, attack_list, options, data, missing_data, attacks, error, log, quiet
) -> None:
    """Before any model loads: an attack without its data is skipped; none left is an error."""
    missing = missing_data(eval_data, attack_list, options)
    if set(missing) == set(attack_list):
        usable = [a for a in attacks if a not in missing_data(eval_data, attacks, options)]
        raise error(
            f"nothing to evaluate: every attack of --attacks lacks its data in {data} ("
            + "; ".join(f"{a}: {why}" for a, why in missing.items())
            + ")"
            + (
                f"; it supports --attacks {','.join(usable)}"
                if usable
                else "; pass --data with a partition directory that has the data"
            )
            + (
                " (canaries are added by `scpdr partition ... --canaries 1,3,10`)"
                if "canary" in missing
                else ""
            )
            + "; nothing was written"
        )
    for a, why in missing.items():
        if quiet and len(missing) < len(attack_list):  # the default list on the user's data
            log.info("%s skipped: %s (%s)", a, why, data)
        else:
            log.warning("%s skipped: %s (%s)", a, why, data)


def _tag_m(rows: list[Any], m: int, *, sweep: bool) -> list[Any]:
    """In an m sweep, rows of the smoothed methods carry their ``m``; a sweep point's rows also
    ``sweep`` (without a sweep the rows are the pipeline's, as an experiment's stages write)."""
    from dataclasses import replace

    out = []
    for r in rows:
        spec = SPECS.get(r.method)
        if spec is not None and spec.smoothed:
            extra = {**r.extra, "m": m, **({"sweep": "m"} if sweep else {})}
            r = replace(r, extra=extra)
        out.append(r)
    return out


def _write_and_print(
    out, rows, timings, report, eval_data, method_list, main_m, ms, *, extra_tables=(), closing=()
) -> None:
    import logging

    from rich.console import Console

    from scpdr.attacks.lira import plot_roc
    from scpdr.attacks.results import save_results
    from scpdr.attacks.risk import RISK_FILE, risk_lines, save_risk
    from scpdr.io import atomic_write_json, atomic_write_text
    from scpdr.report import main_table, to_markdown, to_rich
    from scpdr.report.mia_table import mia_table, power_lines
    from scpdr.report.owndata import method_paragraphs, risk_table, sweep_table

    out.mkdir(parents=True, exist_ok=True)
    save_results(rows, out / "results.json")
    atomic_write_json(out / "timings.json", timings)
    lines = risk_lines(report.secrets)
    save_risk(out / RISK_FILE, lines)
    if report.lira:
        plot_roc(report.lira, out / "lira_roc.png")
        atomic_write_json(out / "roc.json", {eval_data.corpus: report.roc_curves()})
    tables = [main_table(rows, title=f"Main results ({eval_data.corpus}, m = {main_m})")]
    mia = mia_table(rows, title=f"Membership inference ({eval_data.corpus})")
    if mia is not None:  # with its No CP-val row and the power line
        tables.append(mia)
        for line in power_lines(rows):
            if "Warning" in line:
                logging.getLogger(__name__).warning("membership: %s", line)
    if lines:
        tables.append(risk_table(lines, top=10))
    if ms is not None and len(ms) > 1:
        tables.append(sweep_table(rows, ms, default_m=main_m))
    tables += list(extra_tables)
    paragraphs = method_paragraphs(rows, method_list, m=main_m)
    console = Console()
    if not console.is_terminal:  # a file or a pipe: no wrapping of the wide tables
        console = Console(width=200)
    for t in tables:
        console.print(to_rich(t))
        for note in t.notes:
            console.print(note, style="dim", soft_wrap=True)
        console.print()
    for p in paragraphs:
        console.print(p, soft_wrap=console.is_terminal is False)
        console.print()
    md = "\n".join(
        f"## {t.title}\n\n{to_markdown(t)}\n" + "".join(f"{n}\n" for n in t.notes) for t in tables
    )
    md += "\n## What was measured, and what the certificates cover\n\n"
    md += "\n\n".join(paragraphs) + "\n"
    if closing:  # the budget sweep's operating point
        md += "\n## Operating point\n\n" + "\n\n".join(closing) + "\n"
        for line in closing:
            console.print(line, soft_wrap=True)
    atomic_write_text(out / "report.md", md)
    logging.getLogger(__name__).info(
        "wrote %d result rows and %d risk lines to %s", len(rows), len(lines), out
    )
    typer.echo(str(out / "results.json"))
