# DDP training (torchrun): token blocks + serialized model -> final model folder, metrics, profile.
# Checkpoints live in results/train/checkpoints/<run identity>/ (not a declared output, so that a
# killed or forced job resumes from them, and one whose identity is finished writes final/ from it
# without training); train.resume: never starts that identity afresh. The log is appended to:
# two attempts (a rerun beside a job Snakemake lost) never overwrite each other's.
rule train:
    input:
        cfg=resolved_config("train"),
        tokens=rules.prepare_data.output.tokens,
        tokenizer=rules.prepare_data.output.tokenizer,
        model=rules.serialize_model.output.model,
    output:
        **outputs_of("train"),
    log:
        "logs/train/train.log",
    benchmark:
        benchmark_of("train")
    conda:
        "../envs/torch.yaml"
    threads: config["train"]["nproc_per_node"]
    params:
        script=entry_point("train.py"),
        cfg=params_of("train"),
        nproc=config["train"]["nproc_per_node"],
        max_restarts=config["train"]["max_restarts"],
        out=lambda wildcards, output: str(Path(output.metrics).parent),
    shell:
        "{resources.torchrun} --nproc-per-node={params.nproc}"
        " --max-restarts={params.max_restarts} {params.script:q}"
        " --config {input.cfg:q} --tokens {input.tokens:q} --tokenizer {input.tokenizer:q}"
        " --model {input.model:q} --out {params.out:q}"
        " --rank-log 'logs/train/rank{{rank}}.log' >> {log:q} 2>&1"
