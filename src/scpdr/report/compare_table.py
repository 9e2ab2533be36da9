"""The report's "Against the DP baselines" table: what a user would pick instead of SCP-Δr-b — one
model trained with DP-SGD (:data:`scpdr.methods.DP_METHODS`) — next to No CP, SCP-Δr-b and
SCP-Δr-b over DP-trained constituents, then No CP-val as the reference; only when the rows carry a
DP row.

Columns, every cell with its 95% interval (:func:`~scpdr.report.cells.format_ci`): PII FER, the
main table's canary exposure cell (Mean), TTE ACC, the strongest membership test of the suite
(:data:`~scpdr.attacks.mia.MIA_ATTACKS`: the one with the highest TPR at 1% FPR, chosen per row
and corpus by :func:`strongest_test`) with its TPR@1% and its AUC, and next-token accuracy; per
corpus where the run has several. Only main-run rows (no sweep point).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scpdr import methods as M
from scpdr.attacks.mia import MIA_ATTACKS, MIA_LABELS, auc_distance, metric_name
from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.cells import Column, Table, format_ci, marked_with_reference
from scpdr.report.main_table import COLUMN_SPECS, ColumnSpec
from scpdr.report.rows import corpora_for, main_rows, pick, row_value

__all__ = ["COMPARED", "compare_table", "strongest_test"]

#: The rows compared, in table order: the undefended model, the DP models, SCP-Δr-b, and the NAF
#: rule over DP-trained constituents (all named by the registry).
COMPARED: tuple[str, ...] = (
    "none",
    *(m for m in M.DP_METHODS if M.SPECS[m].kind == "single"),
    M.canonical("scp-delta-r"),
    *(m for m in M.DP_METHODS if M.SPECS[m].kind == "retrained"),
)

_TPR = metric_name(0.01)
_MIA = "Strongest MIA"


def _spec(attack: str, label: str) -> ColumnSpec:
    return next(s for s in COLUMN_SPECS if s.attack == attack and s.label == label)


#: The main table's cells this table shows before and after the membership columns.
_BEFORE = (_spec("pii", "FER"), _spec("canary", "Mean"), _spec("tte", "ACC"))
_UTILITY = _spec("utility", "ACC")


def strongest_test(
    rows: Sequence[Mapping[str, Any]], *, method: str, corpus: str | None
) -> str | None:
    """The attack of :data:`~scpdr.attacks.mia.MIA_ATTACKS` with the highest TPR@1% point
    estimate for ``method`` on ``corpus`` (ties: the AUC farther from .5, then the suite's
    order); None when no test has a TPR@1%."""
    best, best_key = None, None
    for attack in MIA_ATTACKS:
        kw = {"method": method, "attack": attack, "corpus": corpus}
        tpr = row_value(pick(rows, metrics=(_TPR,), **kw))
        if tpr is None:
            continue
        auc = row_value(pick(rows, metrics=("auc",), **kw))
        key = (tpr, -1.0 if auc is None else auc_distance(auc))
        if best_key is None or key > best_key:
            best, best_key = attack, key
    return best


def _ci(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "-"
    return format_ci(row_value(row), row.get("ci_low"), row.get("ci_high"))


def compare_table(
    rows: Iterable[Any],
    *,
    corpus_labels: Mapping[str, str] | None = None,
    title: str = "Against the DP baselines",
) -> Table | None:
    """The comparison table of result rows; None without a row of a DP method."""
    rows = [r for r in main_rows(rows) if r.get("method") in (*COMPARED, NO_CP_VAL)]
    if not any(r.get("method") in M.DP_METHODS for r in rows):
        return None
    labels = dict(corpus_labels or {})
    mia_corpora = list(dict.fromkeys(c for a in MIA_ATTACKS for c in corpora_for(rows, a)))
    per_spec = {s: corpora_for(rows, s.attack) for s in (*_BEFORE, _UTILITY)}
    named = {c for cs in (*per_spec.values(), mia_corpora) for c in cs if c is not None}
    multi = len(named) > 1

    def sub(corpus: str | None) -> str:
        return labels.get(corpus, corpus) if multi and corpus is not None else ""

    def spec_columns(spec: ColumnSpec) -> list[Column]:
        return [
            Column(spec.group, sub(c), spec.label, spec.direction, spec.attack, spec.metrics, c)
            for c in per_spec[spec]
        ]

    columns = [c for s in _BEFORE for c in spec_columns(s)]
    for c in mia_corpora:
        columns += [
            Column(_MIA, sub(c), "test", "down", None, (), c),
            Column(_MIA, sub(c), "TPR@1%", "down", None, (_TPR,), c),
            Column(_MIA, sub(c), "AUC", "center", None, ("auc",), c),
        ]
    columns += spec_columns(_UTILITY)

    def cells_of(method: str) -> list[tuple[float | None, str]]:
        tests = {c: strongest_test(rows, method=method, corpus=c) for c in mia_corpora}
        out: list[tuple[float | None, str]] = []
        for col in columns:
            if col.group != _MIA:
                attack = col.attack or ""
                r = pick(rows, method=method, attack=attack, metrics=col.metrics, corpus=col.corpus)
            elif (test := tests[col.corpus]) is None:
                r = None
            elif not col.metrics:  # the test's name
                out.append((None, MIA_LABELS[test]))
                continue
            else:
                r = pick(rows, method=method, attack=test, metrics=col.metrics, corpus=col.corpus)
            out.append((row_value(r), _ci(r)))
        return out

    found = {m: cells_of(m) for m in (*COMPARED, NO_CP_VAL)}
    found = {m: f for m, f in found.items() if any(t != "-" for _, t in f)}
    keep = [j for j in range(len(columns)) if any(f[j][1] != "-" for f in found.values())]
    columns = [columns[j] for j in keep]
    values = {m: [f[j][0] for j in keep] for m, f in found.items()}
    texts = {m: [f[j][1] for j in keep] for m, f in found.items()}
    methods = [m for m in COMPARED if m in found]
    cells, keys, separator = marked_with_reference(values, methods, columns, texts, NO_CP_VAL)
    notes = [
        "What a user would deploy instead of SCP-Δr-b: one model trained with DP-SGD, beside No "
        "CP and the NAF rows. Attacks ↓, utility ↑, the strongest test's AUC ranked by "
        "|AUC − .5|; best per column in bold, second underlined (among the method rows); ±: "
        "half the 95% bootstrap interval; -: not measured.",
        "Strongest MIA: per row (and corpus), the test of the suite with the highest TPR at 1% "
        "FPR (its point estimate; ties go to the AUC farther from .5), so two rows may name "
        "different tests; the AUC shown is the same test's. The marks rank point estimates: a "
        "row beats another only where their intervals say so, so read every claim against the "
        "± and against No CP-val (the level each attack reaches on data no model saw).",
    ]
    return Table(
        title=title,
        columns=columns,
        row_labels=[M.label(k) for k in keys],
        row_keys=keys,
        cells=cells,
        separator_before=separator,
        notes=notes,
    )
