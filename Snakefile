"""distlm: raw text -> GPT-2-class model -> generated text, across many processes and machines.

snakemake --profile profiles/local                      # embedded default, one machine
snakemake --profile profiles/slurm --configfile config/gpt2-wikitext2.yaml
snakemake --profile profiles/local --forcerun train     # rerun one stage and what follows
snakemake --report report.html                          # the standard Snakemake report
"""

import os

from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/config.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/broadcast.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/inference.smk"
include: "workflow/rules/serve.smk"
# The report of the runs: one run's report, or the runs of a sweep side by side (PLAN.report_rules).
include: f"workflow/rules/{PLAN.report_rules}"


# Every declared output of every job of the DAG (distlm.dag.stages.JOBS), in each of its variants, the
# report's figures and tables included (so a report.formats edit that adds a format asks for the
# new files and reruns the report).
rule all:
    default_target: True
    input:
        targets_of(job for job in JOBS if job != "report"),
        rules.report.output,
