"""``scpdr eval BUNDLE --attacks ... --methods ... --out DIR``: run attacks on a bundle's methods.

Writes ``DIR/results.json`` (result rows ``{"method", "attack", "metric", "value", ...}``),
``DIR/timings.json`` (wall time per method and attack) and, with LiRA, ``DIR/lira_roc.png`` and
``DIR/roc.json``. The data (target partition, validation set, canaries) comes from ``--data``
(a partition directory written by ``scpdr partition``/``scpdr train``) or from the bundle's
manifest (``extra.partitions``, set by ``scpdr train``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from scpdr.device import DEVICE_HELP
from scpdr.methods import MAIN_TABLE_METHODS, SPECS

_DEFAULT_METHODS = ",".join(MAIN_TABLE_METHODS)
_KNOWN_METHODS = ", ".join(n for n, s in SPECS.items() if s.kind == "aggregate")


def eval_(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for results.json."),
    attacks: str = typer.Option(
        "pii,canary,tte,lira,utility",
        "--attacks",
        help="Comma-separated: canary, pii, tte, lira, utility.",
    ),
    methods: str = typer.Option(
        _DEFAULT_METHODS,
        "--methods",
        help=f"Comma-separated result-row methods: {_KNOWN_METHODS} (scpdr.methods; "
        "scp-delta-r = scp-delta-r-b).",
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
    m: int | None = typer.Option(
        None, "--m", min=1, help="Smoothing parameter m (default: the bundle's)."
    ),
    n_reference: int = typer.Option(
        10_000,
        "--n-reference",
        min=1,
        help="Random canary candidates for the exposure extrapolation.",
    ),
    pii_n: int | None = typer.Option(None, "--pii-n", min=1, help="Names attacked (default: all)."),
    tte_n: int | None = typer.Option(64, "--tte-n", min=1, help="Training examples for TTE."),
    q_fails: bool = typer.Option(
        False, "--q-fails", help="Also TTE restricted to tokens q (constituent 1) fails to predict."
    ),
    lira_n: int | None = typer.Option(
        None, "--lira-n", min=1, help="Members and non-members each."
    ),
    utility_n: int | None = typer.Option(None, "--utility-n", min=1, help="Validation examples."),
    max_tokens: int = typer.Option(
        256, "--max-tokens", min=1, help="Tokens per example (TTE, LiRA, utility)."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Sequences per scoring batch."),
    seed: int = typer.Option(0, "--seed", help="Seed of the canary reference sample."),
    device: str | None = typer.Option(None, "--device", help=DEVICE_HELP),
) -> None:
    """Run attacks against the methods of a bundle and write DIR/results.json."""
    import logging

    from scpdr.attacks.evaluation import (
        ATTACKS,
        BUNDLE_METHODS,
        EvalData,
        EvalOptions,
        bundle_data_dir,
        check_attacks,
        load_scorers,
        missing_data,
        run_eval,
    )
    from scpdr.attacks.lira import plot_roc
    from scpdr.attacks.results import save_results
    from scpdr.commands import check_m, check_out_dir, split_list
    from scpdr.device import resolve_device
    from scpdr.errors import ConfigError
    from scpdr.io import atomic_write_json
    from scpdr.methods import resolve
    from scpdr.models import read_bundle

    log = logging.getLogger(__name__)
    check_out_dir(out)
    device = resolve_device(device)  # a bad or missing device fails before any work
    attack_list = split_list(attacks, "--attacks", "canary, pii, tte, lira, utility")
    check_attacks(attack_list)  # before any model is loaded
    method_list = split_list(methods, "--methods", _DEFAULT_METHODS.replace(",", ", "))
    # result-row names (an alias names its row), checked before any model loads
    method_list = list(dict.fromkeys(resolve(n, allowed=BUNDLE_METHODS).name for n in method_list))
    manifest = read_bundle(bundle)
    check_m(m, manifest.vocab_size)
    if methods == _DEFAULT_METHODS:  # the defaults: only the variants this bundle can run
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
    data = bundle_data_dir(bundle, manifest, data)
    dataset_name = (manifest.extra.get("dataset") or {}).get("name")
    eval_data = EvalData.from_partitions(data, target=target, corpus=corpus or dataset_name)
    if members is not None:
        from scpdr.data import load_records

        eval_data.members = list(load_records(members))  # prompted: the response given the prompt
    options = EvalOptions(
        n_reference=n_reference,
        batch_size=batch_size,
        pii_n=pii_n,
        pii_val_n=pii_n,
        tte_n=tte_n,
        tte_max_tokens=max_tokens,
        tte_q_fails=q_fails,
        lira_n=lira_n,
        lira_max_tokens=max_tokens,
        utility_n=utility_n,
        utility_max_tokens=max_tokens,
        seed=seed,
    )
    # before any model loads: an attack without its data is skipped; none left is an error
    missing = missing_data(eval_data, attack_list, options)
    if set(missing) == set(attack_list):
        usable = [a for a in ATTACKS if a not in missing_data(eval_data, ATTACKS, options)]
        raise ConfigError(
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
        log.warning("%s skipped: %s (%s)", a, why, data)
    scorers = load_scorers(bundle, method_list, m=m, reference=reference, device=device)
    report = run_eval(scorers, eval_data, attack_list, options=options)
    if not report.rows:  # e.g. LiRA alone without a reference model
        raise ConfigError(
            f"no result rows: every attack of --attacks {','.join(attack_list)} was skipped "
            "(the log says why); nothing was written"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_results(report.rows, out / "results.json")
    atomic_write_json(out / "timings.json", report.timings)
    if report.lira:
        plot_roc(report.lira, out / "lira_roc.png")
        atomic_write_json(out / "roc.json", {eval_data.corpus: report.roc_curves()})
    log.info("wrote %d result rows to %s", len(report.rows), out / "results.json")
    typer.echo(str(out / "results.json"))
