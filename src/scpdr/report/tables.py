"""The report's tables, built from result rows ``{"method", "attack", "metric", "value", "n",
"std", "corpus", ...}`` (``docs/dev/contracts.md``).

- :func:`main_table` — the paper's Table 3 with its NAS column (:mod:`scpdr.report.main_table`).
- :func:`kx_table` — the 99th-percentile k_x table (paper App. E, Table "k_x").
- :func:`canary_table` — exposure per repetition count (paper App. E, canary table).
- :func:`mia_table` — the membership-inference suite: ROC AUC and TPR@1% per method and attack
  (:mod:`scpdr.report.mia_table`).
- :func:`generations_table` — greedy continuations side by side.

A table is plain data (:class:`~scpdr.report.cells.Table`); :func:`to_markdown`, :func:`to_html`
and :func:`to_rich` (:mod:`scpdr.report.formats`) render it. Method rows are named, labelled and
ordered by :mod:`scpdr.methods`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scpdr import methods as M
from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.cells import (
    Cell,
    Column,
    Table,
    format_value,
    methods_table,
    rank_marks,
)
from scpdr.report.formats import to_html, to_markdown, to_rich
from scpdr.report.main_table import COLUMN_SPECS, main_table, nas_scores
from scpdr.report.mia_table import mia_table
from scpdr.report.rows import corpora_for, main_rows, ordered_methods, pick, row_value

__all__ = [
    "COLUMN_SPECS",
    "Cell",
    "Column",
    "Table",
    "canary_table",
    "format_value",
    "generations_table",
    "kx_table",
    "main_table",
    "mia_table",
    "nas_scores",
    "rank_marks",
    "to_html",
    "to_markdown",
    "to_rich",
]


def kx_table(
    rows: Iterable[Any],
    *,
    corpus_labels: Mapping[str, str] | None = None,
    metric: str = "k_x_p99",
    quantity: str = "k_x",
    title: str = "99th percentile of k_x",
) -> Table | None:
    """Methods × corpora table of a bound's 99th percentile (rows ``attack == "bounds"``,
    ``metric == metric``); None when there are no such rows."""
    rows = [r for r in main_rows(rows) if r.get("attack") == "bounds" and r.get("metric") == metric]
    if not rows:
        return None
    labels = dict(corpus_labels or {})
    corpora = corpora_for(rows, "bounds")
    methods = ordered_methods(rows, None)
    columns = [
        Column(
            f"{quantity} (99%)",
            labels.get(c, c or "") if c else "",
            "",
            "down",
            "bounds",
            (metric,),
            c,
        )
        for c in corpora
    ]
    vals = {
        m: [
            row_value(pick(rows, method=m, attack="bounds", metrics=(metric,), corpus=c))
            for c in corpora
        ]
        for m in methods
    }
    notes = ["Lower is better: a smaller bound means less can be learned about one partition."]
    return methods_table(title, columns, vals, methods, notes)


def canary_table(
    rows: Iterable[Any], *, title: str = "Canary exposure by repetitions"
) -> Table | None:
    """Exposure mean / 95% per repetition count (paper App. E canary table), with the
    random-canary baseline (never-inserted canaries, ``repetitions == 0``) as a last row; None
    without per-repetition rows."""
    rows = [
        r
        for r in main_rows(rows)
        if r.get("attack") == "canary" and r.get("repetitions") is not None
    ]
    reps = sorted({int(r["repetitions"]) for r in rows if int(r["repetitions"]) > 0})
    if not reps:
        return None
    columns: list[Column] = []
    for rep in reps:
        for spec in COLUMN_SPECS[:2]:
            columns.append(
                Column("Canary", f"REP={rep}", spec.label, "down", "canary", spec.metrics, None)
            )

    def val(m: str, j: int, rep: int) -> float | None:
        for metric in columns[j].metrics:
            for r in rows:
                if (
                    r.get("method") == m
                    and int(r["repetitions"]) == rep
                    and r.get("metric") == metric
                ):
                    return row_value(r)
        return None

    methods = [m for m in ordered_methods(rows, None)]
    vals = {m: [val(m, j, reps[j // 2]) for j in range(len(columns))] for m in methods}
    notes = [
        "Exposure in bits (Carlini et al. 2019). Random baseline: never-inserted canaries of "
        "the same format under No CP (the same for every repetition count)."
    ]
    table = methods_table(title, columns, vals, methods, notes)
    source = next(
        (
            m
            for m in (NO_CP_VAL, "none")
            if any(r.get("method") == m and int(r["repetitions"]) == 0 for r in rows)
        ),
        None,
    )
    if source is not None:  # an unmarked reference row below the methods
        base = [val(source, j, 0) for j in range(len(columns))]
        table.separator_before = len(table.row_keys)
        table.row_keys.append("baseline")
        table.row_labels.append("Random baseline")
        table.cells.append([Cell(v, format_value(v)) for v in base])
    return table


def generations_table(
    generations: Sequence[Mapping[str, Any]], methods: Sequence[str]
) -> Table | None:
    """Side-by-side generations: one row per prompt, one column per method (text cells)."""
    if not generations:
        return None
    columns = [Column("Prompt", "", "", "down"), Column("Training text", "", "", "down")]
    columns += [Column(M.label(m), "", "", "down") for m in methods]
    cells = []
    for g in generations:
        outs = g.get("outputs", {})
        row = [g.get("prompt", ""), g.get("reference", "")] + [outs.get(m, "-") for m in methods]
        cells.append([Cell(None, str(t)) for t in row])
    return Table(
        title="Generations on training prompts (greedy)",
        columns=columns,
        row_labels=[str(i + 1) for i in range(len(generations))],
        row_keys=[str(i) for i in range(len(generations))],
        cells=cells,
        corner="#",
    )
