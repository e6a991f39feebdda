rule prepare_data:
    output:
        tokens="results/data/tokens.h5",
        tokenizer=directory("results/data/tokenizer"),
        stats="results/data/stats.json",
    log:
        "logs/data/prepare.log",
    benchmark:
        "results/benchmarks/prepare_data.tsv"
    conda:
        "../envs/data.yaml"
    threads: 2
    params:
        sections=stage_sections("data"),
    script:
        "../scripts/prepare_data.py"


TARGETS["data"] = rules.prepare_data.output
