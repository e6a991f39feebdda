# Model download/serialize: hub id, local folder or seeded init -> model folder (safetensors).
rule serialize_model:
    input:
        **inputs_of("model"),
    output:
        **outputs_of("model"),
    log:
        log_of("logs/model/serialize.log"),
    benchmark:
        benchmark_of("serialize_model")
    conda:
        "../envs/torch.yaml"
    threads: 2
    params:
        cfg=params_of("model"),
    script:
        "../scripts/serialize_model.py"


# Pipeline shards: a model folder cut into inference.stages shards (sha256 manifest), read only
# by the pipeline-parallel stages; so a change of inference.stages re-cuts, never retrains.
rule shard:
    input:
        **inputs_of("shard"),
    output:
        **outputs_of("shard", model="{model}"),
    log:
        log_of("logs/shard/{model}.log"),
    benchmark:
        benchmark_of("shard_{model}")
    conda:
        "../envs/torch.yaml"
    threads: 1
    params:
        cfg=params_of("shard"),
    script:
        "../scripts/shard.py"
