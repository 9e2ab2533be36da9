"""The report's table model and ranking: a :class:`Table` of :class:`Cell` s under
:class:`Column` s, the paper's number format (:func:`format_value`), a value with its 95%
interval (:func:`format_ci`: ``.60 ±.12``) and the best / second-best marks of every column
(:func:`rank_marks`; bold and underlined in the paper's tables). A membership AUC column ranks by
``|AUC − .5|`` (direction "center": an AUC below .5 is leakage too, never the best protection).

A table is plain data; :mod:`scpdr.report.formats` renders it as Markdown, HTML or a rich table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scpdr import methods as M

__all__ = [
    "NEAR_CHANCE",
    "Cell",
    "Column",
    "Mark",
    "Table",
    "format_ci",
    "format_value",
    "marked_cells",
    "marked_with_reference",
    "methods_table",
    "rank_marks",
]

Mark = Literal["best", "second"] | None
Direction = Literal["down", "up", "center"]
_ARROWS = {"down": "↓", "up": "↑", "center": "→.5"}
#: Appended to a cell that is not distinguishable at 95% from the reference row (No CP-val).
NEAR_CHANCE = "°"


@dataclass
class Column:
    """One column: a group (attack), a sub-header (corpus) and a label (metric), the direction in
    which values are better, and what it reads from the rows."""

    group: str
    sub: str  # corpus label ("" for the NAS column)
    label: str
    direction: Direction
    attack: str | None = None
    metrics: tuple[str, ...] = ()
    corpus: str | None = None
    weight: float = 0.0  # NAS weight (0: not an attack column)

    @property
    def arrow(self) -> str:
        return _ARROWS[self.direction]

    @property
    def header(self) -> str:
        parts = [f"{self.group} {self.arrow}"]
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


def format_ci(value: float | None, low: float | None, high: float | None, *, mark: str = "") -> str:
    """``.60 ±.12``: the value and half its 95% interval (the interval itself, possibly
    asymmetric, is in ``results.json``); the value alone without an interval. ``mark`` is
    appended (e.g. :data:`NEAR_CHANCE`)."""
    text = format_value(value)
    ok = all(x is not None and math.isfinite(float(x)) for x in (value, low, high))
    if ok and text != "-":
        text += " ±" + format_value((float(high) - float(low)) / 2.0)  # type: ignore[arg-type]
    return text + mark


def _rank_key(value: float) -> float:
    """Values equal at the displayed precision tie."""
    text = format_value(value).replace("<.001", "0").replace("∞", "inf")
    try:
        return float(text)
    except ValueError:
        return value


def _directed(v: float, direction: Direction) -> float:
    if direction == "center":  # a membership AUC: distance from chance, either side
        return _rank_key(abs(v - 0.5))
    return _rank_key(v) if direction == "down" else -_rank_key(v)


def rank_marks(values: Sequence[float | None], direction: Direction) -> list[Mark]:
    """'best' for every value equal (at display precision) to the best, 'second' for the next
    distinct value; None/NaN values are not ranked. Direction "center" ranks by the distance
    from 0.5 (a membership AUC)."""
    keyed = [
        _directed(v, direction) if v is not None and not math.isnan(v) else None for v in values
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


def marked_cells(
    values: Mapping[str, Sequence[float | None]],
    methods: Sequence[str],
    columns: Sequence[Column],
    texts: Mapping[str, Sequence[str]] | None = None,
) -> list[list[Cell]]:
    """One row of cells per method of ``methods`` (``values[m][j]``: method m, column j); in each
    column the best value among ``methods`` is marked "best" and the next "second"
    (:func:`rank_marks`, in the column's direction). ``texts`` replaces the displayed text
    (e.g. with an interval); default :func:`format_value`."""
    marks: dict[str, list[Mark]] = {m: [None] * len(columns) for m in methods}
    for j, col in enumerate(columns):
        col_marks = rank_marks([values[m][j] for m in methods], col.direction)
        for m, mk in zip(methods, col_marks, strict=True):
            marks[m][j] = mk
    out = []
    for m in methods:
        shown = texts[m] if texts is not None else [format_value(v) for v in values[m]]
        out.append([Cell(v, t, mk) for v, t, mk in zip(values[m], shown, marks[m], strict=True)])
    return out


def marked_with_reference(
    values: Mapping[str, Sequence[float | None]],
    methods: Sequence[str],
    columns: Sequence[Column],
    texts: Mapping[str, Sequence[str]],
    reference: str,
) -> tuple[list[list[Cell]], list[str], int | None]:
    """:func:`marked_cells` of ``methods``, then the ``reference`` row (e.g. No CP-val) unmarked
    below a separator when ``values`` has it: ``(cells, row keys, separator index or None)``."""
    cells = marked_cells(values, methods, columns, texts)
    keys = list(methods)
    separator = None
    if reference in values:
        separator = len(keys)
        keys.append(reference)
        shown = zip(values[reference], texts[reference], strict=True)
        cells.append([Cell(v, t) for v, t in shown])
    return cells, keys, separator


def methods_table(
    title: str,
    columns: list[Column],
    values: Mapping[str, Sequence[float | None]],
    methods: Sequence[str],
    notes: list[str],
) -> Table:
    """A table of one row per method of ``methods`` that has any value, in that order, with the
    best and second value of each column marked (:func:`marked_cells`)."""
    methods = [m for m in methods if any(v is not None for v in values[m])]
    return Table(
        title=title,
        columns=columns,
        row_labels=[M.label(m) for m in methods],
        row_keys=methods,
        cells=marked_cells(values, methods, columns),
        notes=notes,
    )
