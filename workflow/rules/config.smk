# Tiny jobs that only write a file: run them where Snakemake runs, never as cluster jobs.
localrules:
    resolve_config,


rule resolve_config:
    output:
        "results/config/{stage}.json",
    log:
        "logs/config/{stage}.log",
    conda:
        "../envs/data.yaml"
    params:
        sections=lambda wc: stage_sections(wc.stage),
    script:
        "../scripts/resolve_config.py"
