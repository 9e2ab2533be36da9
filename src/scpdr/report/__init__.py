"""Tables, plots and the Markdown/HTML report of an experiment (layer 6 of ``shared/DESIGN.md``).

Input is the list of result rows of ``results.json`` (``{"method", "attack", "metric", "value",
"n", "std", "corpus", ...}``) plus optional bound distributions, ROC curves and generations; see
:class:`scpdr.report.render.ReportInputs`.
"""

from __future__ import annotations

from scpdr.report.render import READING_GUIDE, RenderedReport, ReportInputs, render_report
from scpdr.report.tables import (
    Table,
    canary_table,
    format_value,
    kx_table,
    main_table,
    mia_table,
    nas_scores,
    to_html,
    to_markdown,
    to_rich,
)
from scpdr.report.verdicts import verdicts

__all__ = [
    "READING_GUIDE",
    "RenderedReport",
    "ReportInputs",
    "Table",
    "canary_table",
    "format_value",
    "kx_table",
    "main_table",
    "mia_table",
    "nas_scores",
    "render_report",
    "to_html",
    "to_markdown",
    "to_rich",
    "verdicts",
]
