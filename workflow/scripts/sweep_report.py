"""The report of a sweep: the runs side by side, each run's own report (rule report, sweep.smk)."""

from pathlib import Path

from distlm.core.log import setup_logging
from distlm.dag.stages import RESULTS
from distlm.dag.sweep import SweepDescription
from distlm.report.compare import build_sweep_report
from distlm.settings.report import ReportConfig

snakemake = snakemake
log = setup_logging(snakemake.log[0])
try:
    written = build_sweep_report(
        RESULTS,
        Path(snakemake.output.summary).parent,
        runs=SweepDescription.model_validate(snakemake.params.sweep),
        formats=ReportConfig.of(snakemake.params.cfg).report.formats,
        exclude_rules=[snakemake.rule],
    )
except Exception:
    log.exception("sweep report failed")
    raise
undeclared = set(snakemake.output) - {str(p) for p in written}
if undeclared:
    raise RuntimeError(f"rule report: outputs not written: {sorted(undeclared)}")
