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


if SWEEP:

    # A sweep (docs/sweeps.md): every job once per variant, one report comparing the runs.
    include: "workflow/rules/sweep.smk"

    rule all:
        default_target: True
        input:
            SWEEP_TARGETS,
            rules.report.output,

else:

    include: "workflow/rules/serve.smk"
    include: "workflow/rules/report.smk"

    # Every declared output of every stage in the DAG, the report's figures and tables included
    # (so a report.formats edit that adds a format asks for the new files and reruns the report).
    rule all:
        default_target: True
        input:
            rules.prepare_data.output,
            rules.serialize_model.output,
            rules.broadcast.output,
            rules.train.output,
            expand(rules.evaluate.output.json, model=EVAL_MODELS),
            rules.inference.output,
            rules.report.output,
