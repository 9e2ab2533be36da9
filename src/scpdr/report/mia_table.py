"""The membership-inference table: rows = methods (then No CP-val), columns = the MIA suite's
attacks (``scpdr.attacks.mia``) × {ROC AUC, TPR at 1% FPR}, every cell with its 95% interval.

AUC columns rank by ``|AUC − .5|`` (an AUC below .5 is a flipped test, as much leakage as its
mirror: never the best protection); TPR@1% ranks low-is-better. A cell not distinguishable from
No CP-val at 95% — the same attack on examples no model saw, attacked as if they were members:
what the test reaches without membership — is marked ``°``.

Every table says what its test can resolve (:func:`power_lines`): with N non-members the
smallest false-positive rate an attack can be read at is 1/N, so TPR@1% needs N >= 100 and
TPR@0.1% N >= 1000; with fewer, the table warns that the column is read at 1/N instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scpdr import methods as M
from scpdr.attacks.mia import MIA_ATTACKS, MIA_LABELS
from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.cells import NEAR_CHANCE, Column, Table, format_ci, marked_with_reference
from scpdr.report.rows import corpora_for, differs, main_rows, ordered_methods, pick, row_value

__all__ = ["MIA_COLUMNS", "MIN_NONMEMBERS", "mia_table", "power_lines"]

#: (metric, label, direction) of each attack's columns.
MIA_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("auc", "AUC", "center"),
    ("tpr@0.01fpr", "TPR@1%", "down"),
)

#: Non-members a TPR at 1% FPR needs (one false positive in 100). The same rule as
#: ``scpdr.data.user_data.MIN_NONMEMBERS``: a report stage does not import the data layer (its
#: stage hash covers report, attacks and methods only).
MIN_NONMEMBERS = 100


def power_lines(rows: Iterable[Any]) -> list[str]:
    """What the membership tests of ``rows`` can resolve: ``"members M / non-members N; the
    smallest FPR N non-members can resolve is 1/N (x%)"`` per corpus, and a warning when N <
    :data:`MIN_NONMEMBERS` (TPR@1% cannot be resolved: it is read at 1/N, as TPR@0.1% is)."""
    rows = [r for r in main_rows(rows) if r.get("attack") in MIA_ATTACKS]
    rows = [r for r in rows if r.get("metric") == "auc" and r.get("method") != NO_CP_VAL]
    out = []
    corpora = list(dict.fromkeys(r.get("corpus") for r in rows))
    for corpus in corpora:
        sel = [r for r in rows if r.get("corpus") == corpus]
        mem = max(int(r.get("n_members") or 0) for r in sel)
        non = min(int(r.get("n_nonmembers") or 0) for r in sel)
        if non <= 0:
            continue
        where = f" ({corpus})" if len(corpora) > 1 and corpus else ""
        line = (
            f"Power{where}: members {mem} / non-members {non}; the smallest FPR {non} "
            f"non-members can resolve is 1/{non} ({1 / non:.2%})."
        )
        if non < MIN_NONMEMBERS:
            line += (
                f" Warning: fewer than {MIN_NONMEMBERS} non-members, so TPR@1% cannot be "
                f"resolved (it is read at FPR 1/{non}, and TPR@0.1% is the same number); "
                "hold out more validation records for a test with that power."
            )
        elif non < 10 * MIN_NONMEMBERS:
            line += f" TPR@0.1% needs {10 * MIN_NONMEMBERS} non-members: it is read at 1/{non}."
        out.append(line)
    return out


def _population_note(rows: list[dict[str, Any]]) -> str:
    auc = [r for r in rows if r.get("metric") == "auc" and r.get("method") != NO_CP_VAL]
    if not auc:
        return ""
    pops = sorted({str(r.get("population") or "records") for r in auc})
    mem = sorted({int(r.get("n_members") or 0) for r in auc if r.get("attack") != "lira"})
    non = sorted({int(r.get("n_nonmembers") or 0) for r in auc})
    lira = sorted({int(r.get("n_members") or 0) for r in auc if r.get("attack") == "lira"})
    what = {
        "canaries": "membership canaries inserted once into partition 0 vs never inserted",
        "records": "partition-0 records vs validation records",
    }
    text = "; ".join(what.get(p, p) for p in pops)
    span = lambda xs: "–".join(str(x) for x in (xs[0], xs[-1]) if x) if xs else "?"  # noqa: E731
    out = f"Members vs non-members: {text} ({span(mem)} members, {span(non)} non-members"
    if lira and lira != mem:
        out += f"; LiRA: the {span(lira)} members its reference p0 was trained without"
    return out + ")."


def mia_table(
    rows: Iterable[Any],
    *,
    corpus_labels: Mapping[str, str] | None = None,
    title: str = "Membership inference",
) -> Table | None:
    """The MIA table of result rows (``attack`` in :data:`~scpdr.attacks.mia.MIA_ATTACKS`); None
    without such rows."""
    rows = [r for r in main_rows(rows) if r.get("attack") in MIA_ATTACKS]
    if not rows:
        return None
    labels = dict(corpus_labels or {})
    corpora = list(dict.fromkeys(c for a in MIA_ATTACKS for c in corpora_for(rows, a)))
    multi = len(corpora) > 1
    columns: list[Column] = []
    for corpus in corpora:
        for attack in MIA_ATTACKS:
            for metric, label, direction in MIA_COLUMNS:
                if any(
                    r.get("attack") == attack
                    and r.get("metric") == metric
                    and r.get("corpus") == corpus
                    for r in rows
                ):
                    sub = labels.get(corpus, corpus or "") if multi and corpus else ""
                    columns.append(
                        Column(MIA_LABELS[attack], sub, label, direction, attack, (metric,), corpus)  # type: ignore[arg-type]
                    )
    if not columns:
        return None
    methods = [m for m in ordered_methods(rows, None)]
    every = [*methods, NO_CP_VAL]

    def found(m: str) -> list[Mapping[str, Any] | None]:
        return [
            pick(rows, method=m, attack=c.attack or "", metrics=c.metrics, corpus=c.corpus)
            for c in columns
        ]

    raw = {m: found(m) for m in every}
    raw = {m: f for m, f in raw.items() if any(x is not None for x in f)}
    methods = [m for m in methods if m in raw]
    ref = raw.get(NO_CP_VAL, [None] * len(columns))

    def text(m: str, j: int) -> str:
        r = raw[m][j]
        if r is None:
            return "-"
        near = m != NO_CP_VAL and differs(r, ref[j]) is False
        mark = NEAR_CHANCE if near else ""
        return format_ci(row_value(r), r.get("ci_low"), r.get("ci_high"), mark=mark)

    values = {m: [row_value(r) for r in raw[m]] for m in raw}
    texts = {m: [text(m, j) for j in range(len(columns))] for m in raw}
    cells, keys, separator = marked_with_reference(values, methods, columns, texts, NO_CP_VAL)
    notes = [
        "ROC AUC and TPR at 1% FPR of each membership test (Ref: log-likelihood ratio against "
        "the base model; LiRA: against the same method over p0, trained without the members). "
        "AUC ranked by |AUC − .5| (bold = closest to chance; an AUC below .5 is leakage too: "
        "the flipped test); TPR@1% ↓. ±: half the 95% stratified bootstrap interval; "
        f"{NEAR_CHANCE}: not distinguishable from No CP-val at 95% (No CP on examples no model "
        "saw, attacked as members: the level each test reaches by chance).",
    ]
    pop = _population_note(rows)
    if pop:
        notes.append(pop)
    if NO_CP_VAL not in raw:
        notes.append(
            "No CP-val: not measured — no held-out record was left beyond the non-members to "
            "attack as if a member (the chance level needs them); no cell can be marked "
            f"{NEAR_CHANCE}, compare AUCs with .5 instead."
        )
    notes += power_lines(rows)
    return Table(
        title=title,
        columns=columns,
        row_labels=[M.label(k) for k in keys],
        row_keys=keys,
        cells=cells,
        separator_before=separator,
        notes=notes,
    )
