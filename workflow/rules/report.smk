# Profile reports: every stage's metrics -> figures, tables and one self-contained HTML summary,
# each registered with report() so `snakemake --report report.html` shows them too.
from distlm.report.items import category, outputs as report_items

REPORT_DIR = STAGES["report"].dir


rule report:
    input:
        # Every other stage's final outputs: the report runs once, after all of them, and again
        # when one changes. Benchmark TSVs and optional files (the profiler tables) are read from
        # disk by the script; an absent one shows as "not collected", it is not requested here.
        targets_of(STAGES["report"].consumes),
    output:
        *[
            report(
                f"{REPORT_DIR}/{path}",
                caption=f"../report/{item.name}.rst",
                category=category(item.section),
                labels={"item": item.title, "type": item.kind, "file": path},
            )
            for item, path in report_items(S.report.formats)
        ],
        summary=report(
            STAGES["report"].path("summary"),
            caption="../report/summary.rst",
            category="0. Summary",
            labels={
                "item": "HTML summary of every stage",
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
    script:
        "../scripts/report.py"
