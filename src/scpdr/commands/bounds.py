"""``scpdr bounds BUNDLE --out DIR``: per-position k_x / t_x / v_x distributions of a bundle.

Typical tokens: every position of the prompts in ``--prompts`` (a text file, one prompt per line,
or JSONL/CSV records) or of the target partition's training texts (``--data`` or the bundle's
``extra.partitions``). Rare tokens: the secret words of the inserted canaries, when the data has
canaries. ``v_x`` needs ``--reference`` (p0, trained without the targets, Theorem 4.5).

Writes ``DIR/results.json`` (rows ``attack="bounds"``, metrics ``k_x_p99``, ``t_x_rare_mean``,
...), ``DIR/distributions.json`` (``{corpus: {quantity: {method: values}}}``, the report's input)
and ``DIR/bounds_hist.png`` (log-scale histograms).
"""

from __future__ import annotations

from pathlib import Path

import typer

from scpdr.methods import BOUND_METHODS, MAIN_TABLE_METHODS

# the main table's methods that have bounds (not No CP, whose k_x is no protection, nor CP-Fuse)
_DEFAULT_METHODS = ",".join(m for m in MAIN_TABLE_METHODS if m in BOUND_METHODS and m != "none")


def bounds(
    bundle: Path = typer.Argument(..., help="Bundle directory (scpdr.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory."),
    methods: str = typer.Option(
        _DEFAULT_METHODS,
        "--methods",
        help=f"Comma-separated, among: {', '.join(BOUND_METHODS)}.",
    ),
    prompts: Path | None = typer.Option(
        None, "--prompts", help="Text file (one prompt per line) or JSONL/CSV records."
    ),
    data: Path | None = typer.Option(
        None, "--data", help="Partition directory (default: the bundle's extra.partitions)."
    ),
    corpus: str | None = typer.Option(None, "--corpus", help="Corpus name in the rows."),
    reference: str | None = typer.Option(
        None, "--reference", help="Model ref of p0 for v_x (Theorem 4.5); without it no v_x."
    ),
    n: int = typer.Option(32, "--n", min=1, help="Prompts / training examples used."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Tokens per prompt."),
    m: int | None = typer.Option(
        None, "--m", min=1, help="Smoothing parameter m (default: the bundle's)."
    ),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Sequences per scoring batch."),
) -> None:
    """Distributions of the NAF bound k_x and the LiRA bounds t_x, v_x on real prompts."""
    import logging

    from scpdr import models as M
    from scpdr.attacks.bounds_analysis import (
        bound_distributions,
        plot_bound_histograms,
        split_bound_method,
    )
    from scpdr.attacks.evaluation import (
        EvalData,
        bundle_bases,
        bundle_data_dir,
        load_scorers,
        smoothing_method,
    )
    from scpdr.attacks.results import save_results
    from scpdr.attacks.scorer import encode
    from scpdr.commands import check_m, check_out_dir, split_list
    from scpdr.errors import ConfigError
    from scpdr.io import atomic_write_json

    log = logging.getLogger(__name__)
    check_out_dir(out)
    method_list = split_list(methods, "--methods", _DEFAULT_METHODS.replace(",", ", "))
    specs = {name: split_bound_method(name) for name in method_list}
    manifest = M.read_bundle(bundle)
    check_m(m, manifest.vocab_size)
    if prompts is not None and not prompts.is_file():
        raise FileNotFoundError(f"--prompts {prompts}: no such file")

    # the prompts first: a missing data source fails before any model loads
    canaries, space = [], None
    name = corpus or (manifest.extra.get("dataset") or {}).get("name") or "prompts"
    if prompts is not None:
        if prompts.suffix in (".jsonl", ".csv"):
            from scpdr.data import load_records

            typical = [r.text for r in load_records(prompts)]
        else:
            typical = [ln for ln in prompts.read_text(encoding="utf-8").splitlines() if ln.strip()]
    else:
        data = bundle_data_dir(bundle, manifest, data, instead="--prompts FILE or ")
        ed = EvalData.from_partitions(data, corpus=corpus)
        typical, name, space = ed.train, ed.corpus, ed.canary_space
        canaries = [c for c in ed.canaries if c.repetitions > 0]
    typical = typical[:n]
    if not typical:
        raise ConfigError("no prompts to compute bounds on")

    base_vector = bundle_bases(bundle, manifest, [src for _, src in specs.values()])
    # one scorer whose components carry the constituents' and the base's log-probs
    through = smoothing_method("model" if manifest.base is not None else "constant")
    scorers = load_scorers(bundle, [through], m=m, reference=reference)
    scorer = scorers[through]
    ref_scorer = scorers.reference_of("none") if reference is not None else None  # p0 alone
    mm = scorers.m
    common = dict(
        methods=method_list,
        m=mm,
        ref_scorer=ref_scorer,
        base_vector=base_vector,
        max_tokens=max_tokens,
        batch_size=batch_size,
    )
    dist = {"typical": bound_distributions(scorer, typical, **common)}
    rows = dist["typical"].rows(corpus=name)
    report_dists = dist["typical"].as_report_distributions()
    if canaries and space is not None:
        tok = scorer.tokenizer
        seqs, starts = [], []
        for c in canaries:
            prefix = encode(tok, c.prefix)
            secret = encode(tok, space.render(c.secret), add_special_tokens=False)
            seqs.append(prefix + secret)
            starts.append(len(prefix))  # the first secret token's index
        dist["rare"] = bound_distributions(scorer, seqs, start=starts, **common)
        rows += dist["rare"].rows(corpus=name, rare=True)
        report_dists.update(dist["rare"].as_report_distributions(rare=True))
    out.mkdir(parents=True, exist_ok=True)
    save_results(rows, out / "results.json")
    atomic_write_json(out / "distributions.json", {name: report_dists})
    plot_bound_histograms(dist, out / "bounds_hist.png")
    for r in rows:
        if r.metric in ("k_x_p99", "k_x_rare_p99"):
            log.info("%s %s: %.4g", r.method, r.metric, r.value)
    typer.echo(str(out / "results.json"))
