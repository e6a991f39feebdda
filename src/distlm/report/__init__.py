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

from distlm.report.build import build_report
from distlm.report.inputs import LAYOUT, Inputs, ReportError, collect
from distlm.report.items import FIGURES, ITEMS, SECTIONS, SUMMARY, TABLES, Item, category, outputs

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
