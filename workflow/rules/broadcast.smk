# Weight broadcast (torchrun, 1 sender + broadcast.receivers; null: one rank per GPU): rank 0 sends the serialized model to
# every other rank through distlm.transfer (the module training uses for its initial weights);
# every receiver verifies each bucket's checksum; rank 0 writes the JSON report.
rule broadcast:
    input:
        cfg=resolved_config("broadcast"),
        model=upstream("serialize_model", "model"),
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
        "{resources.torchrun} --nproc-per-node={params.nproc} -m distlm.entry.broadcast"
        " --config {input.cfg:q} --model {input.model:q} --report {output.report:q}"
        " --rank-log {params.rank_log:q} > {log:q} 2>&1"
