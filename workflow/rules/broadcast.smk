# Weight broadcast (torchrun, 1 sender + broadcast.receivers): rank 0 sends the serialized model to
# every other rank through distlm.transfer (the module training uses for its initial weights);
# every receiver verifies each bucket's checksum; rank 0 writes the JSON report.
rule broadcast:
    input:
        cfg="results/config/broadcast.json",
        model=rules.serialize_model.output.model,
    output:
        report="results/broadcast/report.json",
    log:
        "logs/broadcast/torchrun.log",
    benchmark:
        "results/benchmarks/broadcast.tsv"
    conda:
        "../envs/torch.yaml"
    threads: 1 + config["broadcast"]["receivers"]
    params:
        sections=stage_sections("broadcast"),
        script=entry_point("broadcast.py"),
        nproc=1 + config["broadcast"]["receivers"],
    shell:
        "{resources.torchrun} --nproc-per-node={params.nproc} {params.script:q}"
        " --config {input.cfg:q} --model {input.model:q} --report {output.report:q}"
        " --rank-log 'logs/broadcast/rank{{rank}}.log' > {log:q} 2>&1"


TARGETS["broadcast"] = rules.broadcast.output
