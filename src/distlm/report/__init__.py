"""Profile reports: every stage's metrics -> pandas tables, matplotlib figures, one HTML summary.

    from distlm.report import build_report
    build_report("results", "results/report", formats=["png"])

writes results/report/summary.html (self-contained: figures embedded as base64, tables inline, opens
from disk), results/report/figures/<name>.<fmt> and results/report/tables/<name>.html. The
workflow's rule `report` registers each of them with Snakemake's `report()` (captions in
workflow/report/<name>.rst), so `snakemake --report report.html` shows them too.

An absent input (a stage not run, profiling off) gives a "not collected" note in the summary and a
figure or table that says so; a malformed metrics file raises ReportError naming the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names
from distlm.report.items import FIGURES, ITEMS, SECTIONS, SUMMARY, TABLES, Item, category, outputs

if TYPE_CHECKING:  # for the type checker: at run time they load lazily (below)
    from distlm.report.build import build_report
    from distlm.report.inputs import LAYOUT, Inputs, ReportError, collect

# pandas and matplotlib load with the readers and the builder, on first use: the workflow imports
# distlm.report.items while it builds the DAG and needs neither.
_LAZY = {
    "build_report": "distlm.report.build",
    "LAYOUT": "distlm.report.inputs",
    "Inputs": "distlm.report.inputs",
    "ReportError": "distlm.report.inputs",
    "collect": "distlm.report.inputs",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "FIGURES",
    "ITEMS",
    "LAYOUT",
    "SECTIONS",
    "SUMMARY",
    "TABLES",
    "Inputs",
    "Item",
    "ReportError",
    "build_report",
    "category",
    "collect",
    "outputs",
]
