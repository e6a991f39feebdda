rule prepare_data:
    output:
        tokens="results/data/tokens.h5",
        tokenizer=directory("results/data/tokenizer"),
        stats="results/data/stats.json",
    params:
        sections=stage_sections("data"),
    log:
        "logs/data/prepare.log",
    benchmark:
        "results/benchmarks/prepare_data.tsv"
    threads: 2
    conda:
        "../envs/data.yaml"
    script:
        "../scripts/prepare_data.py"


TARGETS["data"] = rules.prepare_data.output
