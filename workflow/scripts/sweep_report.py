"""The report of a sweep: the runs side by side, each run's own report (rule report, sweep.smk)."""

from pathlib import Path

from distlm.log import setup_logging
from distlm.report.sweep import build_sweep_report
from distlm.stages import RESULTS

snakemake = snakemake
log = setup_logging(snakemake.log[0])
try:
    written = build_sweep_report(
        RESULTS,
        Path(snakemake.output.summary).parent,
        runs=snakemake.params.sweep,
        formats=snakemake.params.cfg["report"]["formats"],
        exclude_rules=[snakemake.rule],
    )
except Exception:
    log.exception("sweep report failed")
    raise
undeclared = set(snakemake.output) - {str(p) for p in written}
if undeclared:
    raise RuntimeError(f"rule report: outputs not written: {sorted(undeclared)}")
