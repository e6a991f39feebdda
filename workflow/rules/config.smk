rule resolve_config:
    output:
        "results/config/{stage}.json",
    params:
        sections=lambda wc: stage_sections(wc.stage),
    log:
        "logs/config/{stage}.log",
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/resolve_config.py"
