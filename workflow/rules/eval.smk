# Checkpoint evaluation (torchrun): sliding-window perplexity of the serialized base model and of
# the final training checkpoint, every split in eval.splits, one JSON per model.
rule evaluate:
    input:
        cfg=resolved_config("eval"),
        tokens=upstream("prepare_data", "tokens"),
        model=model_folder,
    output:
        **outputs_of("eval", model="{model}"),
    log:
        log_of("logs/eval/{model}.log"),
    benchmark:
        benchmark_of("evaluate_{model}")
    conda:
        "../envs/torch.yaml"
    threads: setting("eval.nproc_per_node")
    params:
        script=entry_point("evaluate.py"),
        cfg=params_of("eval"),
        nproc=setting("eval.nproc_per_node"),
    shell:
        sweep_shell(
            "{resources.torchrun} --nproc-per-node={params.nproc} {params.script:q}"
            " --config {input.cfg:q} --model {input.model:q} --tokens {input.tokens:q}"
            " --name {wildcards.model} --out {output.json:q}"
            " --rank-log 'logs/eval/{wildcards.model}.rank{{rank}}.log' > {log:q} 2>&1"
        )
