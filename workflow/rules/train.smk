# DDP training (torchrun): token blocks + serialized model -> final model folder, metrics, profile.
# Checkpoints live in results/train/checkpoints/<run identity>/ (not a declared output, so that a
# killed or forced job resumes from them, and one whose identity is finished writes final/ from it
# without training); train.resume: never starts that identity afresh. The log is appended to:
# two attempts (a rerun beside a job Snakemake lost) never overwrite each other's.
rule train:
    input:
        cfg=resolved_config("train"),
        tokens=upstream("prepare_data", "tokens"),
        tokenizer=upstream("prepare_data", "tokenizer"),
        model=upstream("serialize_model", "model"),
    output:
        **outputs_of("train"),
    log:
        log_of("logs/train/train.log"),
    benchmark:
        benchmark_of("train")
    conda:
        "../envs/torch.yaml"
    threads: setting("train.nproc_per_node")
    params:
        script=entry_point("train.py"),
        cfg=params_of("train"),
        nproc=setting("train.nproc_per_node"),
        max_restarts=setting("train.max_restarts"),
        out=lambda wildcards, output: str(Path(output.metrics).parent),
    shell:
        sweep_shell(
            "{resources.torchrun} --nproc-per-node={params.nproc}"
            " --max-restarts={params.max_restarts} {params.script:q}"
            " --config {input.cfg:q} --tokens {input.tokens:q} --tokenizer {input.tokenizer:q}"
            " --model {input.model:q} --out {params.out:q}"
            " --rank-log 'logs/train/rank{{rank}}.log' >> {log:q} 2>&1"
        )
