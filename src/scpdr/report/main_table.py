"""The paper's main table (Table 3) from result rows, and its NAS column (§5.4).

:func:`main_table`: rows No CP, CP-Δ, CP-ΔKL, CP-Fuse, CP-Δr, SCP-Δr-c, SCP-Δr-b (and any other
evaluated method, in :data:`scpdr.methods.METHOD_ORDER`), then No CP-val and STE; columns NAS,
Canary Mean/95%, PII AEL/FER, TTE AUC/ACC per corpus, Utility ACC per corpus. Best value of a
column in bold, second underlined, among the method rows (not No CP-val / STE); direction per
column: attacks ↓, utility ↑. Every cell with an interval reads ``.60 ±.12`` (half the 95%
bootstrap interval over examples); an attack cell not distinguishable from No CP-val at 95%
(:func:`scpdr.report.rows.differs`) is marked ``°``.

NAS (paper §5.4, "Main results"): every attack column is min-max normalized to [0, 1] over the
rows except STE (No CP-val included), and NAS is the weighted mean of a row's normalized scores.
Training-time baselines (Goldfish, the DP rows) are read on that scale without setting it
(:mod:`scpdr.attacks.nas`): adding one changes no other row's NAS.
Each attack type carries the weight of its own two columns: a column's weight is 1 / (the number
of corpora that attack is reported on), so the paper's three TTE corpora get 1/3 each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from scpdr import methods as M
from scpdr.attacks.results import NO_CP_VAL, STE  # the reference rows below the methods
from scpdr.report.cells import NEAR_CHANCE, Cell, Column, Table, format_ci, marked_cells
from scpdr.report.rows import (
    corpora_for,
    differs,
    main_rows,
    ordered_methods,
    pick,
    row_value,
    ste_of,
)

__all__ = ["COLUMN_SPECS", "ColumnSpec", "main_table", "nas_scores"]


@dataclass(frozen=True)
class ColumnSpec:
    group: str
    attack: str
    metrics: tuple[str, ...]  # accepted metric names (first match wins)
    label: str
    direction: Literal["down", "up"]
    per_corpus: bool


COLUMN_SPECS: tuple[ColumnSpec, ...] = (
    ColumnSpec("Canary", "canary", ("mean", "exposure_mean"), "Mean", "down", False),
    ColumnSpec("Canary", "canary", ("p95", "exposure_p95"), "95%", "down", False),
    ColumnSpec("PII", "pii", ("ael",), "AEL", "down", False),
    ColumnSpec("PII", "pii", ("fer",), "FER", "down", False),
    # the user's declared secrets (scpdr.attacks.secrets): share extracted, share whole
    ColumnSpec("Secrets", "secrets", ("extracted",), "Extr.", "down", True),
    ColumnSpec("Secrets", "secrets", ("fer",), "FER", "down", True),
    ColumnSpec("TTE", "tte", ("auc",), "AUC", "down", True),
    ColumnSpec("TTE", "tte", ("acc",), "ACC", "down", True),
    ColumnSpec("Utility", "utility", ("acc", "accuracy"), "ACC", "up", True),
)
"""Main-table columns in the paper's order; NAS comes first and is computed."""


def nas_scores(
    values: Mapping[str, Sequence[float | None]],
    weights: Sequence[float],
    *,
    scale_exclude: Sequence[str] = tuple(M.BASELINE_METHODS),
) -> dict[str, float | None]:
    """NAS per row (paper §5.4) with :func:`scpdr.attacks.nas.nas`: min-max normalize every
    column over the given rows, then the weighted mean of each row's normalized scores (missing
    and non-finite values skipped; None for a row with no value).

    ``values``: row key → one value per attack column (the STE row must not be passed).
    ``scale_exclude``: rows read on the others' scale (default: the training-time baselines).
    """
    from scpdr.attacks.nas import nas

    table = {k: {j: v for j, v in enumerate(vals) if v is not None} for k, vals in values.items()}
    scores = nas(table, weights=dict(enumerate(weights)), exclude=(), scale_exclude=scale_exclude)
    return {k: (v if math.isfinite(v) else None) for k, v in scores.items()}


def main_table(
    rows: Iterable[Any],
    *,
    methods: Sequence[str] | None = None,
    corpus_labels: Mapping[str, str] | None = None,
    title: str = "Main results",
) -> Table:
    """The paper's main table (Table 3) from result rows of the main run.

    ``methods``: row order (default: the paper's order, then any other method present).
    ``corpus_labels``: corpus name → column label (e.g. ``{"names2ids": "IDs"}``).
    Columns without any value are left out; No CP-val utility equals No CP's (same held-out
    data) when the attacks did not report it separately; STE is std/√n of the No CP-val values.
    """
    rows = main_rows(rows)
    labels = dict(corpus_labels or {})
    order = ordered_methods(rows, methods)

    columns: list[Column] = []
    attacks = list(dict.fromkeys(spec.attack for spec in COLUMN_SPECS))
    for attack in attacks:
        specs = [s for s in COLUMN_SPECS if s.attack == attack]
        corpora = corpora_for(rows, attack)
        for corpus in corpora:  # the paper groups by corpus, metrics inside
            for spec in specs:
                weight = 0.0 if spec.direction == "up" else 1.0 / len(corpora)
                columns.append(
                    Column(
                        spec.group,
                        labels.get(corpus, corpus) if corpus is not None else "",
                        spec.label,
                        spec.direction,
                        attack=spec.attack,
                        metrics=spec.metrics,
                        corpus=corpus,
                        weight=weight,
                    )
                )

    # Keep only columns with at least one value.
    def column_value(method: str, col: Column) -> Mapping[str, Any] | None:
        return pick(
            rows, method=method, attack=col.attack or "", metrics=col.metrics, corpus=col.corpus
        )

    columns = [c for c in columns if any(column_value(m, c) for m in [*order, NO_CP_VAL])]

    values: dict[str, list[float | None]] = {}
    raw: dict[str, list[Mapping[str, Any] | None]] = {}
    for method in [*order, NO_CP_VAL]:
        found = [column_value(method, c) for c in columns]
        if method == NO_CP_VAL:
            for j, c in enumerate(columns):
                if found[j] is None and c.attack == "utility":
                    found[j] = column_value("none", c)
        if method == NO_CP_VAL and not any(found):
            continue
        raw[method] = found
        values[method] = [row_value(r) for r in found]
    present_methods = [m for m in order if m in values]

    attack_idx = [j for j, c in enumerate(columns) if c.weight > 0]
    nas = nas_scores(
        {m: [values[m][j] for j in attack_idx] for m in values},
        [columns[j].weight for j in attack_idx],
    )
    nas_col = Column("NAS", "", "Mean", "down")
    all_columns = [nas_col, *columns] if attack_idx else list(columns)

    def full_row(method: str) -> list[float | None]:
        vals = list(values[method])
        return [nas[method], *vals] if attack_idx else vals

    table_values = {m: full_row(m) for m in values}

    def cell_text(method: str, j: int) -> str:
        r = raw[method][j]
        if r is None:
            return format_ci(None, None, None)
        mark = ""
        ref = raw.get(NO_CP_VAL, [None] * len(columns))[j]
        if method != NO_CP_VAL and columns[j].weight > 0 and differs(r, ref) is False:
            mark = NEAR_CHANCE
        return format_ci(row_value(r), r.get("ci_low"), r.get("ci_high"), mark=mark)

    texts = {
        m: ([format_ci(nas[m], None, None)] if attack_idx else [])
        + [cell_text(m, j) for j in range(len(columns))]
        for m in table_values
    }
    ste_vals: list[float | None] | None = None
    if NO_CP_VAL in raw:
        ste = [ste_of(r) for r in raw[NO_CP_VAL]]
        if any(v is not None for v in ste):
            ste_vals = [None, *ste] if attack_idx else ste

    row_keys = list(present_methods)
    # marks among these rows
    cells = marked_cells(table_values, present_methods, all_columns, texts)
    separator = None
    if NO_CP_VAL in table_values:
        separator = len(row_keys)
        row_keys.append(NO_CP_VAL)
        cells.append(
            [Cell(v, t) for v, t in zip(table_values[NO_CP_VAL], texts[NO_CP_VAL], strict=True)]
        )
    if ste_vals is not None:
        if separator is None:
            separator = len(row_keys)
        row_keys.append(STE)
        cells.append([Cell(v, format_ci(v, None, None)) for v in ste_vals])
    notes = [
        "Best value per column in bold, second best underlined (among the method rows); "
        "attacks ↓ (lower is better), utility ↑. ±: half the 95% bootstrap interval over "
        f"examples; {NEAR_CHANCE}: not distinguishable from No CP-val at 95% (two-sided test "
        "of the difference, normal approximation with each standard error read off its "
        "interval).",
    ]
    if attack_idx:
        notes.append(
            "NAS: each attack column min-max normalized over the rows (STE excluded), weighted "
            "mean with each attack type weighted equally (paper §5.4); training-time baselines "
            "(Goldfish, DP) are read on the scale the other rows set, without setting it, so "
            "they may fall outside [0, 1]."
        )
    return Table(
        title=title,
        columns=all_columns,
        row_labels=[M.label(k) for k in row_keys],
        row_keys=row_keys,
        cells=cells,
        separator_before=separator,
        notes=notes,
    )
