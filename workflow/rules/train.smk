# Training (torchrun; DDP or FSDP2): token blocks + serialized model -> final model folder, metrics,
# profile.
# Checkpoints live in results/train/checkpoints/<run identity>/ (not a declared output, so that a
# killed or forced job resumes from them, and one whose identity is finished writes final/ from it
# without training); train.resume: never starts that identity afresh. The log is appended to:
# two attempts (a rerun beside a job Snakemake lost) never overwrite each other's.
rule train:
    input:
        **inputs_of("train"),
        cfg=resolved_config("train"),
    output:
        **outputs_of("train"),
    log:
        log_of("logs/train/train.log"),
    benchmark:
        benchmark_of("train")
    conda:
        "../envs/torch.yaml"
    threads: threads_of("train")
    params:
        cfg=params_of("train"),
        nproc=ranks_of("train"),
        max_restarts=per_job(lambda s: s.train.max_restarts),
        out=lambda wildcards, output: str(Path(output.metrics).parent),
        rank_log=rank_log("logs/train/rank{rank}.log"),
    shell:
        torchrun_shell(
            "train",
            ["--tokens", "{input.tokens:q}", "--tokenizer", "{input.tokenizer:q}"]
            + ["--model", "{input.model:q}", "--out", "{params.out:q}"],
            restarts=True,
            append_log=True,
        )
