# Dataset prep (distlm.data): the corpus cut into shards (distlm.data.sharding), one tokenizer
# job, one tokenize job per shard (on SLURM many at once), then prepare_data gathers them: the
# index over the shards, the tokenizer, stats JSON. A shard's file and the tokenizer's folder are
# named by the digest of what they hold, so a finished one is found again by any config (or run
# of a sweep) that asks for it, and adding a file to the corpus tokenizes only its shard.


rule data_tokenizer:
    output:
        tokenizer=directory(DATA.layout.tokenizer("{tokenizer}")),
        info=DATA.layout.tokenizer_info("{tokenizer}"),
    log:
        "logs/data/tokenizers/{tokenizer}.log",
    benchmark:
        f"{BENCHMARKS}/data/tokenizer-{{tokenizer}}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 2
    params:
        spec=lambda wc: DATA.tokenizer(wc.tokenizer).to_json(),
    script:
        "../scripts/data_tokenizer.py"


# One shard of the corpus: its records as a stream, ids written as they are made; its memory is a
# batch, never the shard. `threads`: the tokenizer's (--set-threads tokenize_shard=N).
rule tokenize_shard:
    input:
        tokenizer=lambda wc: DATA.layout.tokenizer(DATA.shard(wc.shard).tokenizer),
    output:
        shard=DATA.layout.shard("{shard}"),
    log:
        "logs/data/shards/{shard}.log",
    benchmark:
        f"{BENCHMARKS}/data/shard-{{shard}}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    resources:
        mem_mb=2000,
    params:
        spec=lambda wc: DATA.shard(wc.shard).to_json(),
    script:
        "../scripts/tokenize_shard.py"


# The gather: the shards' streams strung into one index per split, the tokenizer, the stats.
rule prepare_data:
    input:
        unpack(data_inputs),
    output:
        **outputs_of("data"),
    log:
        log_of("logs/data/prepare.log"),
    benchmark:
        benchmark_of("prepare_data")
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        cfg=params_of("data"),
    script:
        "../scripts/prepare_data.py"
