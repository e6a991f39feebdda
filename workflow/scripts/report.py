"""Profile reports: every stage's metrics -> figures, tables, one HTML summary (rule report)."""

from pathlib import Path

from distlm.core.log import setup_logging
from distlm.dag.stages import RESULTS
from distlm.report import build_report
from distlm.settings.report import ReportConfig

snakemake = snakemake
log = setup_logging(snakemake.log[0])
try:
    written = build_report(
        RESULTS,
        Path(snakemake.output.summary).parent,
        formats=ReportConfig.of(snakemake.params.cfg).report.formats,
        exclude_rules=[snakemake.rule],  # its own benchmark is written after it ends
    )
except Exception:
    log.exception("report failed")
    raise
undeclared = set(snakemake.output) - {str(p) for p in written}
if undeclared:
    raise RuntimeError(f"rule report: outputs not written by build_report: {sorted(undeclared)}")
