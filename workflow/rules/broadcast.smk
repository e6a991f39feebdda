# Weight broadcast (torchrun, 1 sender + broadcast.receivers): rank 0 sends the serialized model to
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
    threads: setting("broadcast.receivers", lambda n: 1 + n)
    params:
        script=entry_point("broadcast.py"),
        cfg=params_of("broadcast"),
        nproc=setting("broadcast.receivers", lambda n: 1 + n),
    shell:
        sweep_shell(
            "{resources.torchrun} --nproc-per-node={params.nproc} {params.script:q}"
            " --config {input.cfg:q} --model {input.model:q} --report {output.report:q}"
            " --rank-log 'logs/broadcast/rank{{rank}}.log' > {log:q} 2>&1"
        )
