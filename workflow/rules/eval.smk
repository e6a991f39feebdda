# Checkpoint evaluation (torchrun): sliding-window perplexity of the serialized base model and of
# the final training checkpoint, every split in eval.splits, one JSON per model.
rule evaluate:
    input:
        **inputs_of("eval"),
        cfg=resolved_config("eval"),
    output:
        **outputs_of("eval", model="{model}"),
    log:
        log_of("logs/eval/{model}.log"),
    benchmark:
        benchmark_of("evaluate_{model}")
    conda:
        "../envs/torch.yaml"
    threads: threads_of("eval")
    params:
        cfg=params_of("eval"),
        nproc=ranks_of("eval"),
        rank_log=rank_log("logs/eval/{model}.rank{rank}.log"),
    shell:
        torchrun_shell(
            "evaluate",
            ["--model", "{input.model:q}", "--tokens", "{input.tokens:q}"]
            + ["--name", "{wildcards.model}", "--out", "{output.json:q}"],
        )
