# Tiny jobs that only write a file: run them where Snakemake runs, never as cluster jobs.
localrules:
    resolve_config,


# The keys a multi-process stage reads, written once for all its ranks; its params are the same
# keys and the document's format tag, so the file changes (and the stage reruns) only when one of
# them does: a file an earlier release wrote in another format is rewritten, never misread.
rule resolve_config:
    output:
        resolved_config("{stage}"),
    log:
        log_of("logs/config/{stage}.log"),
    conda:
        "../envs/data.yaml"
    params:
        cfg=lambda wc: stage_params(PLAN.settings_of(wc), wc.stage),
        format=lambda wc: STAGE_CONFIGS[wc.stage].tag(),
    script:
        "../scripts/resolve_config.py"
