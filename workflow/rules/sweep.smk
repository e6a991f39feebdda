# The report of a sweep (docs/sweeps.md): the runs side by side in results/report/, and each
# run's own report and run.json in results/runs/<run>/. It replaces report.smk's rule when the
# config has a `sweep`; every other rule runs once per job variant (workflow/rules/common.smk).
from distlm.report.items import (
    SWEEP_SECTION,
    category,
    outputs as report_items,
    sweep_outputs,
)
from distlm.dag.sweep import SWEEP_JOBS, describe, run_dir

REPORT_DIR = STAGES["report"].dir
FORMATS = S.report.formats  # one report: its keys are the base config's
SWEEP_DESCRIPTION = describe(PLAN)


rule report:
    input:
        # every output of every job variant of every run
        targets_of(SWEEP_JOBS),
    output:
        *[
            report(
                f"{REPORT_DIR}/{path}",
                caption=f"../report/{item.name}.rst",
                category=SWEEP_SECTION,
                labels={"item": item.title, "type": item.kind, "file": path},
            )
            for item, path in sweep_outputs(FORMATS)
        ],
        *[f"{run_dir(run)}/run.json" for run in PLAN.runs],
        *[
            report(
                f"{run_dir(run)}/report/{path}",
                caption=f"../report/{item.name}.rst",
                category=category(item.section),
                subcategory=item.title,
                labels=SWEEP_DESCRIPTION.labels(run, type=item.kind, file=path),
            )
            for run in PLAN.runs
            for item, path in report_items(FORMATS)
        ],
        *[
            report(
                f"{run_dir(run)}/report/{STAGES['report'].file('summary')}",
                caption="../report/run_summary.rst",
                category="0. Summary",
                subcategory="Each run",
                labels=SWEEP_DESCRIPTION.labels(run, type="page"),
            )
            for run in PLAN.runs
        ],
        summary=report(
            STAGES["report"].path("summary"),
            caption="../report/sweep_summary.rst",
            category="0. Summary",
            labels={
                "item": "HTML summary of the sweep",
                "type": "page",
                "file": STAGES["report"].file("summary"),
            },
        ),
    log:
        job_path("logs/report/report.log", variant=None),
    benchmark:
        benchmark_of("report", variant=None)
    conda:
        "../envs/report.yaml"
    threads: 1
    params:
        cfg=stage_params(S, "report"),
        sweep=SWEEP_DESCRIPTION.model_dump(),
    script:
        "../scripts/sweep_report.py"
