"""The report's tables, built from result rows ``{"method", "attack", "metric", "value", "n",
"std", "corpus", ...}`` (``docs/dev/contracts.md``).

- :func:`main_table` — the paper's Table 3: rows No CP, CP-Δ, CP-ΔKL, CP-Fuse, CP-Δr, SCP-Δr-c,
  SCP-Δr-b (and any other evaluated method), then No CP-val and STE; columns NAS, Canary
  Mean/95%, PII AEL/FER, TTE AUC/ACC per corpus, Utility ACC per corpus. Best value of a column in
  bold, second underlined, among the method rows (not No CP-val / STE); direction per column:
  attacks ↓, utility ↑.
- :func:`kx_table` — the 99th-percentile k_x table (paper App. E, Table "k_x").
- :func:`canary_table` — exposure per repetition count (paper App. E, canary table).

NAS (paper §5.4, "Main results"): every attack column is min-max normalized to [0, 1] over the
rows except STE (No CP-val included), and NAS is the weighted mean of a row's normalized scores.
Each attack type carries the weight of its own two columns: a column's weight is 1 / (the number
of corpora that attack is reported on), so the paper's three TTE corpora get 1/3 each.

A table is plain data (:class:`Table`); :func:`to_markdown`, :func:`to_html` and :func:`to_rich`
render it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "COLUMN_SPECS",
    "MAIN_TABLE_METHODS",
    "METHOD_LABELS",
    "METHOD_ORDER",
    "Cell",
    "Column",
    "Table",
    "canary_table",
    "format_value",
    "generations_table",
    "kx_table",
    "lira_table",
    "main_table",
    "nas_scores",
    "rank_marks",
    "to_html",
    "to_markdown",
    "to_rich",
]

Mark = Literal["best", "second"] | None

METHOD_LABELS: dict[str, str] = {
    "none": "No CP",
    "cp-delta": "CP-Δ",
    "cp-kl": "CP-ΔKL",
    "cp-fuse": "CP-Fuse",
    "cp-delta-r": "CP-Δr",
    "scp-delta-r-c": "SCP-Δr-c",
    "scp-delta-r-b": "SCP-Δr-b",
    "scp-delta": "SCP-Δ (raw)",
    "goldfish": "Goldfish",
    "none-val": "No CP-val",
    "ste": "STE",
}
"""Display names (paper notation)."""

MAIN_TABLE_METHODS: tuple[str, ...] = (
    "none",
    "cp-delta",
    "cp-kl",
    "cp-fuse",
    "cp-delta-r",
    "scp-delta-r-c",
    "scp-delta-r-b",
)
"""The rows of the paper's main table (Table 3), in its order (an experiment's default methods)."""

METHOD_ORDER: tuple[str, ...] = (*MAIN_TABLE_METHODS, "scp-delta", "goldfish")
"""The order of method rows in every table and plot; methods not listed follow, sorted."""

_REFERENCE_ROWS = ("none-val", "ste")


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
    ColumnSpec("TTE", "tte", ("auc",), "AUC", "down", True),
    ColumnSpec("TTE", "tte", ("acc",), "ACC", "down", True),
    ColumnSpec("Utility", "utility", ("acc", "accuracy"), "ACC", "up", True),
)
"""Main-table columns in the paper's order; NAS comes first and is computed."""


@dataclass
class Column:
    group: str
    sub: str  # corpus label ("" for the NAS column)
    label: str
    direction: Literal["down", "up"]
    attack: str | None = None
    metrics: tuple[str, ...] = ()
    corpus: str | None = None
    weight: float = 0.0  # NAS weight (0: not an attack column)

    @property
    def header(self) -> str:
        arrow = "↓" if self.direction == "down" else "↑"
        parts = [f"{self.group} {arrow}"]
        if self.sub:
            parts.append(self.sub)
        if self.label:
            parts.append(self.label)
        return " · ".join(parts)


@dataclass
class Cell:
    value: float | None
    text: str
    mark: Mark = None


@dataclass
class Table:
    title: str
    columns: list[Column]
    row_labels: list[str]
    row_keys: list[str]
    cells: list[list[Cell]]
    separator_before: int | None = None  # index of the first reference row (midrule)
    notes: list[str] = field(default_factory=list)
    corner: str = ""

    def value(self, row_key: str, column_index: int) -> float | None:
        return self.cells[self.row_keys.index(row_key)][column_index].value

    def marks(self, row_key: str) -> list[Mark]:
        return [c.mark for c in self.cells[self.row_keys.index(row_key)]]


# -------------------------------------------------------------------------------- formatting


def format_value(value: float | None) -> str:
    """The paper's style: ``.47`` below 1 (``.002`` below .01, ``<.001`` below .001), ``8.8``
    from 1 to 10, ``28`` from 10 on; ``-`` for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    v = float(value)
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if v == 0:
        return "0"
    a = abs(v)
    sign = "-" if v < 0 else ""
    if a < 1e-3:
        return f"{sign}<.001"
    if a < 0.01:
        s = f"{a:.3f}"
    elif a < 1:
        s = f"{a:.2f}"
    elif a < 10:
        s = f"{a:.1f}"
    else:
        s = f"{a:.0f}"
    if s.startswith("0."):
        s = s[1:]
    if s == "1.00":  # .995 ≤ a < 1 rounds up
        s = "1.0"
    return sign + s


def _rank_key(value: float) -> float:
    """Values equal at the displayed precision tie."""
    text = format_value(value).replace("<.001", "0").replace("∞", "inf")
    try:
        return float(text)
    except ValueError:
        return value


def rank_marks(values: Sequence[float | None], direction: Literal["down", "up"]) -> list[Mark]:
    """'best' for every value equal (at display precision) to the best, 'second' for the next
    distinct value; None/NaN values are not ranked."""
    keyed = [
        (_rank_key(v) if direction == "down" else -_rank_key(v))
        if v is not None and not math.isnan(v)
        else None
        for v in values
    ]
    distinct = sorted({k for k in keyed if k is not None})
    if sum(k is not None for k in keyed) < 2:
        return [None] * len(values)
    best = distinct[0] if distinct else None
    second = distinct[1] if len(distinct) > 1 else None
    out: list[Mark] = []
    for k in keyed:
        if k is None:
            out.append(None)
        elif k == best:
            out.append("best")
        elif k == second:
            out.append("second")
        else:
            out.append(None)
    return out


def _marked_cells(
    values: Mapping[str, Sequence[float | None]],
    methods: Sequence[str],
    columns: Sequence[Column],
) -> list[list[Cell]]:
    """One row of cells per method of ``methods`` (``values[m][j]``: method m, column j); in each
    column the best value among ``methods`` is marked "best" and the next "second"
    (:func:`rank_marks`, in the column's direction)."""
    marks: dict[str, list[Mark]] = {m: [None] * len(columns) for m in methods}
    for j, col in enumerate(columns):
        col_marks = rank_marks([values[m][j] for m in methods], col.direction)
        for m, mk in zip(methods, col_marks, strict=True):
            marks[m][j] = mk
    return [
        [Cell(v, format_value(v), mk) for v, mk in zip(values[m], marks[m], strict=True)]
        for m in methods
    ]


def _methods_table(
    title: str,
    columns: list[Column],
    values: Mapping[str, Sequence[float | None]],
    methods: Sequence[str],
    notes: list[str],
) -> Table:
    """A table of one row per method of ``methods`` that has any value, in that order, with the
    best and second value of each column marked (:func:`_marked_cells`)."""
    methods = [m for m in methods if any(v is not None for v in values[m])]
    return Table(
        title=title,
        columns=columns,
        row_labels=[METHOD_LABELS.get(m, m) for m in methods],
        row_keys=methods,
        cells=_marked_cells(values, methods, columns),
        notes=notes,
    )


# -------------------------------------------------------------------------------- row lookup


def _as_dict(row: Any) -> dict[str, Any]:
    if isinstance(row, Mapping):
        return dict(row)
    to_dict = getattr(row, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"result row must be a mapping, got {type(row).__name__}")


def _main_rows(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Rows of the main run (not of a sweep point)."""
    return [r for r in map(_as_dict, rows) if r.get("sweep") is None]


def _pick(
    rows: Sequence[Mapping[str, Any]],
    *,
    method: str,
    attack: str,
    metrics: Sequence[str],
    corpus: str | None,
) -> Mapping[str, Any] | None:
    """The row of (method, attack, metric, corpus); for canaries with several repetition counts
    the pooled row (no ``repetitions``), else repetitions == 3 (the paper's main setting), else
    the largest."""
    for metric in metrics:
        cands = [
            r
            for r in rows
            if r.get("method") == method
            and r.get("attack") == attack
            and r.get("metric") == metric
            and (corpus is None or r.get("corpus") == corpus)
        ]
        if not cands:
            continue
        pooled = [r for r in cands if r.get("repetitions") is None]
        if pooled:
            return pooled[0]
        three = [r for r in cands if r.get("repetitions") == 3]
        if three:
            return three[0]
        # The largest repetition count; the baseline (0) only when it is all there is.
        return max(cands, key=lambda r: r.get("repetitions") or 0)
    return None


def _value(row: Mapping[str, Any] | None) -> float | None:
    if row is None:
        return None
    v = row.get("value")
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def _ste(row: Mapping[str, Any] | None) -> float | None:
    """Standard error std / sqrt(n) of a No CP-val value (the paper's STE row)."""
    if row is None or row.get("std") is None or not row.get("n"):
        return None
    n = int(row["n"])
    return float(row["std"]) / math.sqrt(n) if n > 0 else None


def _corpora_for(rows: Sequence[Mapping[str, Any]], attack: str) -> list[str | None]:
    seen: dict[str | None, None] = {}
    for r in rows:
        if r.get("attack") == attack:
            seen.setdefault(r.get("corpus"))
    return list(seen)


# -------------------------------------------------------------------------------- NAS


def nas_scores(
    values: Mapping[str, Sequence[float | None]], weights: Sequence[float]
) -> dict[str, float | None]:
    """NAS per row (paper §5.4) with :func:`scpdr.attacks.nas.nas`: min-max normalize every
    column over the given rows, then the weighted mean of each row's normalized scores (missing
    and non-finite values skipped; None for a row with no value).

    ``values``: row key → one value per attack column (the STE row must not be passed).
    """
    from scpdr.attacks.nas import nas

    table = {k: {j: v for j, v in enumerate(vals) if v is not None} for k, vals in values.items()}
    scores = nas(table, weights=dict(enumerate(weights)), exclude=())
    return {k: (v if math.isfinite(v) else None) for k, v in scores.items()}


# -------------------------------------------------------------------------------- tables


def _ordered_methods(rows: Sequence[Mapping[str, Any]], methods: Sequence[str] | None) -> list[str]:
    present = {r.get("method") for r in rows}
    if methods is not None:
        return [m for m in methods if m not in _REFERENCE_ROWS]
    known = [m for m in METHOD_ORDER if m in present]
    other = sorted(m for m in present if m not in METHOD_ORDER and m not in _REFERENCE_ROWS)
    return known + [m for m in other if isinstance(m, str)]


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
    rows = _main_rows(rows)
    labels = dict(corpus_labels or {})
    order = _ordered_methods(rows, methods)

    columns: list[Column] = []
    attacks = list(dict.fromkeys(spec.attack for spec in COLUMN_SPECS))
    for attack in attacks:
        specs = [s for s in COLUMN_SPECS if s.attack == attack]
        corpora = _corpora_for(rows, attack)
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
        return _pick(
            rows, method=method, attack=col.attack or "", metrics=col.metrics, corpus=col.corpus
        )

    columns = [c for c in columns if any(column_value(m, c) for m in [*order, "none-val"])]

    values: dict[str, list[float | None]] = {}
    raw: dict[str, list[Mapping[str, Any] | None]] = {}
    for method in [*order, "none-val"]:
        found = [column_value(method, c) for c in columns]
        if method == "none-val":
            for j, c in enumerate(columns):
                if found[j] is None and c.attack == "utility":
                    found[j] = column_value("none", c)
        if method == "none-val" and not any(found):
            continue
        raw[method] = found
        values[method] = [_value(r) for r in found]
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
    ste_vals: list[float | None] | None = None
    if "none-val" in raw:
        ste = [_ste(r) for r in raw["none-val"]]
        if any(v is not None for v in ste):
            ste_vals = [None, *ste] if attack_idx else ste

    row_keys = list(present_methods)
    cells = _marked_cells(table_values, present_methods, all_columns)  # marks among these rows
    separator = None
    if "none-val" in table_values:
        separator = len(row_keys)
        row_keys.append("none-val")
        cells.append([Cell(v, format_value(v)) for v in table_values["none-val"]])
    if ste_vals is not None:
        if separator is None:
            separator = len(row_keys)
        row_keys.append("ste")
        cells.append([Cell(v, format_value(v)) for v in ste_vals])
    notes = [
        "Best value per column in bold, second best underlined (among the method rows); "
        "attacks ↓ (lower is better), utility ↑.",
    ]
    if attack_idx:
        notes.append(
            "NAS: each attack column min-max normalized over the rows (STE excluded), weighted "
            "mean with each attack type weighted equally (paper §5.4)."
        )
    return Table(
        title=title,
        columns=all_columns,
        row_labels=[METHOD_LABELS.get(k, k) for k in row_keys],
        row_keys=row_keys,
        cells=cells,
        separator_before=separator,
        notes=notes,
    )


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
    rows = [
        r for r in _main_rows(rows) if r.get("attack") == "bounds" and r.get("metric") == metric
    ]
    if not rows:
        return None
    labels = dict(corpus_labels or {})
    corpora = _corpora_for(rows, "bounds")
    methods = _ordered_methods(rows, None)
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
            _value(_pick(rows, method=m, attack="bounds", metrics=(metric,), corpus=c))
            for c in corpora
        ]
        for m in methods
    }
    notes = ["Lower is better: a smaller bound means less can be learned about one partition."]
    return _methods_table(title, columns, vals, methods, notes)


def canary_table(
    rows: Iterable[Any], *, title: str = "Canary exposure by repetitions"
) -> Table | None:
    """Exposure mean / 95% per repetition count (paper App. E canary table), with the
    random-canary baseline (never-inserted canaries, ``repetitions == 0``) as a last row; None
    without per-repetition rows."""
    rows = [
        r
        for r in _main_rows(rows)
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
                    return _value(r)
        return None

    methods = [m for m in _ordered_methods(rows, None)]
    vals = {m: [val(m, j, reps[j // 2]) for j in range(len(columns))] for m in methods}
    notes = [
        "Exposure in bits (Carlini et al. 2019). Random baseline: never-inserted canaries of "
        "the same format under No CP (the same for every repetition count)."
    ]
    table = _methods_table(title, columns, vals, methods, notes)
    source = next(
        (
            m
            for m in ("none-val", "none")
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


def lira_table(
    rows: Iterable[Any],
    *,
    corpus_labels: Mapping[str, str] | None = None,
    title: str = "Membership inference (LiRA)",
) -> Table | None:
    """LiRA ROC AUC and TPR at 1% / 0.1% FPR per method and corpus (rows ``attack == "lira"``);
    None without such rows."""
    rows = [r for r in _main_rows(rows) if r.get("attack") == "lira"]
    if not rows:
        return None
    labels = dict(corpus_labels or {})
    metrics = [("auc", "AUC"), ("tpr@0.01fpr", "TPR@1%"), ("tpr@0.001fpr", "TPR@0.1%")]
    columns = [
        Column("LiRA", labels.get(c, c or "") if c else "", label, "down", "lira", (metric,), c)
        for c in _corpora_for(rows, "lira")
        for metric, label in metrics
        if any(r.get("metric") == metric and r.get("corpus") == c for r in rows)
    ]
    methods = _ordered_methods(rows, None)
    vals = {
        m: [
            _value(_pick(rows, method=m, attack="lira", metrics=c.metrics, corpus=c.corpus))
            for c in columns
        ]
        for m in methods
    }
    notes = [
        "Offline LiRA against the same method over the reference constituents (p0 trained "
        "without the targets); members = the held-out targets, non-members = validation. "
        "AUC 0.5 = chance."
    ]
    return _methods_table(title, columns, vals, methods, notes)


def generations_table(
    generations: Sequence[Mapping[str, Any]], methods: Sequence[str]
) -> Table | None:
    """Side-by-side generations: one row per prompt, one column per method (text cells)."""
    if not generations:
        return None
    columns = [Column("Prompt", "", "", "down"), Column("Training text", "", "", "down")]
    columns += [Column(METHOD_LABELS.get(m, m), "", "", "down") for m in methods]
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


# -------------------------------------------------------------------------------- renderers


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


def to_markdown(table: Table) -> str:
    """GitHub-flavoured Markdown: bold ``**x**``, underline ``<u>x</u>``."""
    head = [table.corner or " "] + [c.header for c in table.columns]
    lines = [
        "| " + " | ".join(_md_escape(h) for h in head) + " |",
        "|" + "---|" + "|".join(":---:" for _ in table.columns) + "|",
    ]
    for i, (label, row) in enumerate(zip(table.row_labels, table.cells, strict=True)):
        if table.separator_before is not None and i == table.separator_before:
            lines.append("| " + " | ".join([" "] * (len(table.columns) + 1)) + " |")
        texts = []
        for cell in row:
            t = _md_escape(cell.text)
            if cell.mark == "best":
                t = f"**{t}**"
            elif cell.mark == "second":
                t = f"<u>{t}</u>"
            texts.append(t)
        lines.append("| " + " | ".join([_md_escape(label), *texts]) + " |")
    return "\n".join(lines) + "\n"


def _header_rows(table: Table) -> list[list[tuple[str, int]]]:
    """Grouped header rows: (text, colspan) per level, merging equal neighbours."""
    levels: list[list[str]] = [
        [
            f"{c.group} {'↓' if c.direction == 'down' else '↑'}" if c.label or c.sub else c.group
            for c in table.columns
        ],
        [c.sub for c in table.columns],
        [c.label for c in table.columns],
    ]
    out = []
    for li, level in enumerate(levels):
        if li > 0 and not any(level):
            continue
        merged: list[tuple[str, int]] = []
        for j, text in enumerate(level):
            # Merge only within the same parent group.
            same_parent = j > 0 and all(levels[p][j] == levels[p][j - 1] for p in range(li))
            if merged and same_parent and text == level[j - 1]:
                merged[-1] = (text, merged[-1][1] + 1)
            else:
                merged.append((text, 1))
        out.append(merged)
    return out


def to_html(table: Table) -> str:
    """An HTML table with grouped headers; bold ``<b>``, underline ``<u>``."""
    parts = [f'<table class="results"><caption>{html.escape(table.title)}</caption><thead>']
    header_rows = _header_rows(table)
    for li, row in enumerate(header_rows):
        parts.append("<tr>")
        if li == 0:
            parts.append(f'<th rowspan="{len(header_rows)}">{html.escape(table.corner)}</th>')
        for text, span in row:
            parts.append(f'<th colspan="{span}">{html.escape(text)}</th>')
        parts.append("</tr>")
    parts.append("</thead><tbody>")
    for i, (label, row) in enumerate(zip(table.row_labels, table.cells, strict=True)):
        cls = (
            ' class="midrule"'
            if table.separator_before is not None and i == table.separator_before
            else ""
        )
        parts.append(f"<tr{cls}><th>{html.escape(label)}</th>")
        for cell in row:
            t = html.escape(cell.text)
            if cell.mark == "best":
                t = f"<b>{t}</b>"
            elif cell.mark == "second":
                t = f"<u>{t}</u>"
            parts.append(f"<td>{t}</td>")
        parts.append("</tr>")
    parts.append("</tbody></table>")
    if table.notes:
        parts.append('<p class="note">' + " ".join(html.escape(n) for n in table.notes) + "</p>")
    return "".join(parts)


def to_rich(table: Table) -> Any:
    """A ``rich.table.Table`` for the terminal: best bold, second underlined."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    rt = RichTable(title=table.title, show_lines=False, header_style="bold")
    rt.add_column(table.corner, style="bold", no_wrap=True)
    for c in table.columns:
        head = "\n".join(
            x for x in (f"{c.group} {'↓' if c.direction == 'down' else '↑'}", c.sub, c.label) if x
        )
        rt.add_column(head, justify="right")
    for i, (label, row) in enumerate(zip(table.row_labels, table.cells, strict=True)):
        texts = []
        for cell in row:
            t = escape(cell.text)
            if cell.mark == "best":
                texts.append(f"[bold]{t}[/bold]")
            elif cell.mark == "second":
                texts.append(f"[underline]{t}[/underline]")
            else:
                texts.append(t)
        rt.add_row(
            escape(label),
            *texts,
            end_section=table.separator_before is not None and i == table.separator_before - 1,
        )
    return rt
