# Profile reports: every stage's metrics -> figures, tables and one self-contained HTML summary,
# each registered with report() so `snakemake --report report.html` shows them too.
from distlm.report import SUMMARY, category, outputs as report_outputs


rule report:
    input:
        # Every other stage's final outputs: the report runs once, after all of them, and again
        # when one changes. Benchmark TSVs and optional files (the profiler tables) are read from
        # disk by the script; an absent one shows as "not collected", it is not requested here.
        stages=lambda wc: [
            t for s, files in TARGETS.items() if s != "report" for t in files
        ],
    output:
        *[
            report(
                f"results/report/{path}",
                caption=f"../report/{item.name}.rst",
                category=category(item.section),
                labels={"item": item.title, "type": item.kind, "file": path},
            )
            for item, path in report_outputs(config["report"]["formats"])
        ],
        summary=report(
            f"results/report/{SUMMARY}",
            caption="../report/summary.rst",
            category="0. Summary",
            labels={
                "item": "HTML summary of every stage",
                "type": "page",
                "file": SUMMARY,
            },
        ),
    log:
        "logs/report/report.log",
    benchmark:
        "results/benchmarks/report.tsv"
    conda:
        "../envs/report.yaml"
    threads: 1
    params:
        sections=stage_sections("report"),
    script:
        "../scripts/report.py"


TARGETS["report"] = [rules.report.output.summary]
