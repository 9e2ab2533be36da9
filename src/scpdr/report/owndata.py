"""What ``scpdr eval`` tells the owner of the data: the records most at risk (with each record's
chance level: whether a model that never saw it produces its secret too), the m sweep, and a
plain-language paragraph per method on what was measured — secrets that came out because they
are guessable apart from those that came out because they were memorized, membership against its
chance level — and what its certificate does and does not cover (docs/certificate.md).

Tables use the report's table model (:class:`~scpdr.report.cells.Table`), so they render on the
terminal (:func:`~scpdr.report.formats.to_rich`) and in Markdown alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scpdr import methods as M
from scpdr.attacks.mia import MIA_ATTACKS
from scpdr.report.cells import Cell, Column, Table, format_value, marked_cells
from scpdr.report.rows import as_dict
from scpdr.report.verdicts import membership_verdict, secrets_verdict

__all__ = ["method_paragraph", "method_paragraphs", "risk_table", "sweep_table"]

_NO_CP = next(n for n, s in M.SPECS.items() if s.rule == "none" and s.kind == "aggregate")


def _find(rows: Sequence[Mapping[str, Any]], method: str, attack: str, metric: str, **kw: Any):
    for r in rows:
        if (r["method"], r["attack"], r["metric"]) == (method, attack, metric) and all(
            r.get(k) == v for k, v in kw.items()
        ):
            return r
    return None


def _risk_methods(names: Sequence[str]) -> list[str]:
    """No CP and the smoothed methods (at most two): the risk table's column groups."""
    first = [n for n in names if n == _NO_CP] or list(names[:1])
    smoothed = [n for n in names if n in M.SPECS and M.SPECS[n].smoothed][-2:]
    rest = [n for n in names if n not in first][-1:]
    return first + (smoothed or rest)


def risk_table(lines: Sequence[Mapping[str, Any]], *, top: int = 10) -> Table:
    """The ``top`` records most at risk (``risk.jsonl``'s order): the record's chance level
    ("Guessable": how much of its most exposed secret a model that never saw it reproduces,
    "whole" when all of it), then for No CP and the protected (smoothed) methods the fraction of
    the most exposed secret extracted, the secrets extracted whole, those of them memorized
    (whole here and not from the chance level) and the ``ref`` score (every method is in
    ``risk.jsonl``)."""
    methods = _risk_methods(list(dict.fromkeys(str(ln["method"]) for ln in lines)))
    records = list(dict.fromkeys(str(ln["record"]) for ln in lines))[:top]
    by = {(str(ln["record"]), str(ln["method"])): ln for ln in lines}
    chance = any(ln.get("counterfactual_extracted") is not None for ln in lines)
    per = ["Extracted", "Whole", *(["Memorized"] if chance else []), "ref"]
    columns = [Column("Partition", "", "", "down")]
    if chance:
        columns.append(Column("Guessable", "", "", "down"))
    for m in methods:
        columns += [Column(M.label(m), "", label, "down") for label in per]
    cells = []
    for rid in records:
        first = next(by[(rid, m)] for m in methods if (rid, m) in by)
        part = first.get("partition")
        row = [Cell(part, "-" if part is None else str(part))]
        if chance:
            cx = first.get("counterfactual_extracted")
            text = (
                "-"
                if cx is None
                else f"{cx:.0%}" + (" whole" if first.get("counterfactual_whole") else "")
            )
            row.append(Cell(cx, text))
        for m in methods:
            ln = by.get((rid, m))
            if ln is None:
                row += [Cell(None, "-")] * len(per)
                continue
            whole = f"{ln['secrets_whole']}/{ln['secrets']}"
            row += [
                Cell(ln["extracted"], f"{ln['extracted']:.0%}"),
                Cell(ln["secrets_whole"], whole),
            ]
            if chance:
                k = ln.get("memorized")
                row.append(Cell(k, "-" if k is None else f"{k}/{ln['secrets']}"))
            row.append(Cell(ln.get("ref"), format_value(ln.get("ref"))))
        cells.append(row)
    notes = [
        "Extracted: share of the record's most exposed secret reproduced from the text "
        "before it; Whole: secrets extracted in full / secrets; ref: log-likelihood ratio of "
        "the record vs the base model (higher = better known than the base model knows it)."
    ]
    if chance:
        notes.append(
            "Guessable: the same query to the constituent(s) that never saw the record (the "
            "record's chance level: a secret such a model produces came out because it can be "
            "guessed, e.g. from the name before it); Memorized: secrets extracted whole by the "
            "method and not by that model: real leaks."
        )
    return Table(
        title=f"Records most at risk (top {len(records)} of "
        f"{len(dict.fromkeys(str(ln['record']) for ln in lines))}, sorted by "
        f"{M.label(methods[0]) if methods else ''})",
        columns=columns,
        row_labels=records,
        row_keys=records,
        cells=cells,
        notes=notes,
        corner="record",
    )


#: The columns of the m-sweep table: (attack, metric, label, direction).
_SWEEP_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("secrets", "extracted", "Secrets Extr.", "down"),
    ("secrets", "fer", "Secrets FER", "down"),
    ("tte", "auc", "TTE AUC", "down"),
    ("lira", "auc", "LiRA AUC", "down"),
    ("utility", "acc", "Utility ACC", "up"),
)


def sweep_table(rows: Iterable[Any], ms: Sequence[int], *, default_m: int) -> Table:
    """Attack and utility numbers of every smoothed method at each m of the sweep (``rows``
    carry ``m``; rows of the default m may lack it), with No CP for comparison."""
    rows = [as_dict(r) for r in rows]
    smoothed = [
        n for n in M.METHOD_ORDER if M.SPECS[n].smoothed and any(r["method"] == n for r in rows)
    ]
    keys: list[tuple[str, int | None]] = [(_NO_CP, None)] + [(n, m) for n in smoothed for m in ms]
    present = [
        (a, mt, lb, d)
        for a, mt, lb, d in _SWEEP_COLUMNS
        if any(r["attack"] == a and r["metric"] == mt for r in rows)
    ]
    columns = [Column(lb, "", "", d) for _, _, lb, d in present]  # type: ignore[arg-type]

    def value(method: str, m: int | None, attack: str, metric: str) -> float | None:
        for r in rows:
            if (r["method"], r["attack"], r["metric"]) != (method, attack, metric):
                continue
            if m is None or r.get("m", default_m) == m:
                return r.get("value")
        return None

    values = {f"{n}@{m}": [value(n, m, a, mt) for a, mt, _, _ in present] for n, m in keys}
    labels = [M.label(n) if m is None else f"{M.label(n)} m={m}" for n, m in keys]
    row_keys = list(values)
    first = [Cell(v, format_value(v)) for v in values[row_keys[0]]]  # No CP: not ranked
    cells = [first, *marked_cells(values, row_keys[1:], columns)]
    return Table(
        title="Choosing m: the smoothed methods at each m (No CP for comparison)",
        columns=columns,
        row_labels=labels,
        row_keys=row_keys,
        cells=cells,
        separator_before=None,
        notes=[
            "Smaller m smooths more tokens towards the base model: less extraction, lower "
            "utility. Choose the largest m whose attack columns stay near No CP-val."
        ],
    )


def _ci(row: Mapping[str, Any] | None, pct: bool = True) -> str:
    if row is None:
        return "not measured"
    v, lo, hi = row.get("value"), row.get("ci_low"), row.get("ci_high")
    fmt = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}")
    if v is None:
        return "not measured"
    ci = f" (95% CI {fmt(lo)}–{fmt(hi)})" if lo is not None and hi is not None else ""
    return f"{fmt(v)}{ci}"


def method_paragraph(
    method: str, rows: Sequence[Mapping[str, Any]], *, m: int | None = None
) -> str:
    """One plain-language paragraph: what was measured for ``method`` and what its certificate
    does and does not cover."""
    spec = M.SPECS.get(method)
    name = M.label(method)
    ext = _find(rows, method, "secrets", "extracted")
    fer = _find(rows, method, "secrets", "fer")
    measured = []
    if ext is not None:
        measured.append(
            f"from the text before each of {ext.get('n', '?')} declared secrets, a greedy "
            f"continuation reproduced {_ci(ext)} of the secret's characters on average, and "
            f"{_ci(fer)} of the secrets in full"
        )
    tte = _find(rows, method, "tte", "auc")
    if tte is not None:
        measured.append(f"token-by-token extraction AUC {tte['value']:.2f} (0.5 = chance)")
    if any(
        r["method"] == method and r["metric"] == "auc" and r["attack"] in MIA_ATTACKS for r in rows
    ):
        measured.append(membership_verdict(rows, method))
    util = _find(rows, method, "utility", "acc")
    if util is not None:
        measured.append(f"next-token accuracy on held-out records {util['value']:.2f}")
    what = "; ".join(measured) if measured else "no attack produced a number"
    chance = secrets_verdict(rows, method)
    if chance is not None:  # the secrets, each against its own chance level
        what += (
            ". Each secret against its chance level (the same query to the constituent(s) that "
            "never saw the record): " + chance.removeprefix("secrets: ")
        )
    if spec is None or spec.rule == "none":
        return (
            f"{name} serves the constituent trained on partition 0 alone: what the data is "
            f"exposed to without protection. Measured: {what}. No certificate: every record of "
            "that partition is in the model that answers."
        )
    parts = [f"{name} serves all constituents through a NAF aggregate. Measured: {what}."]
    if spec.bounded:
        div = {
            "max": "max divergence",
            "relative-max": "relative max divergence",
            "kl": "KL divergence",
        }.get(str(spec.kx_divergence), str(spec.kx_divergence))
        smooth = (
            f", on the constituents smoothed towards the base model but for their m = {m} "
            "most informative tokens"
            if spec.smoothed and m is not None
            else ""
        )
        parts.append(
            f"Certificate: at every generated token the answer's next-token distribution is "
            f"within k_x ({div}{smooth}) of that of a constituent that never saw the record, "
            "and t_x bounds how much more likely the token is than under such a constituent "
            "(a membership test's per-token advantage). A whole response is certified by the "
            "sum of its tokens' charges (docs/certificate.md)."
        )
    else:
        parts.append(
            "Certificate: none per token (the rule is stateful); it is measured, not certified."
        )
    parts.append(
        "Not covered: a secret present in every partition (the audit refuses such data), "
        "what the base model already knows (public facts, formats), and what an attacker "
        "learns by combining many responses beyond the certified budget."
    )
    return " ".join(parts)


def method_paragraphs(
    rows: Iterable[Any], methods: Sequence[str], *, m: int | None = None
) -> list[str]:
    """:func:`method_paragraph` of each method (rows of the main run)."""
    rows = [as_dict(r) for r in rows if as_dict(r).get("sweep") is None]
    return [method_paragraph(n, rows, m=m) for n in methods]
