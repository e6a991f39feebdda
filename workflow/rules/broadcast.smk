# Weight broadcast (torchrun, 1 sender + broadcast.receivers; null: one rank per GPU): rank 0 sends the serialized model to
# every other rank through distlm.transfer (the module training uses for its initial weights);
# every receiver verifies each bucket's checksum; rank 0 writes the JSON report.
rule broadcast:
    input:
        **inputs_of("broadcast"),
        cfg=resolved_config("broadcast"),
    output:
        **outputs_of("broadcast"),
    log:
        log_of("logs/broadcast/torchrun.log"),
    benchmark:
        benchmark_of("broadcast")
    conda:
        "../envs/torch.yaml"
    threads: threads_of("broadcast")
    params:
        cfg=params_of("broadcast"),
        nproc=ranks_of("broadcast"),
        rank_log=rank_log("logs/broadcast/rank{rank}.log"),
    shell:
        torchrun_shell(
            "broadcast",
            ["--model", "{input.model:q}", "--report", "{output.report:q}"],
        )
