"""Renderers of a report :class:`~scpdr.report.cells.Table`: GitHub Markdown, an HTML table with
grouped headers, and a ``rich`` table for the terminal (best value bold, second underlined)."""

from __future__ import annotations

import html
from typing import Any

from scpdr.report.cells import Table

__all__ = ["to_html", "to_markdown", "to_rich"]


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
        [f"{c.group} {c.arrow}" if c.label or c.sub else c.group for c in table.columns],
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


def to_html(table: Table, *, notes: bool = True) -> str:
    """An HTML table with grouped headers; bold ``<b>``, underline ``<u>``; its notes below it
    unless ``notes=False`` (the report prints them once, as its own blocks)."""
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
    if notes and table.notes:
        parts.append('<p class="note">' + " ".join(html.escape(n) for n in table.notes) + "</p>")
    return "".join(parts)


def to_rich(table: Table) -> Any:
    """A ``rich.table.Table`` for the terminal: best bold, second underlined."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    rt = RichTable(title=table.title, show_lines=False, header_style="bold")
    rt.add_column(table.corner, style="bold", no_wrap=True)
    for c in table.columns:
        head = "\n".join(x for x in (f"{c.group} {c.arrow}", c.sub, c.label) if x)
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
