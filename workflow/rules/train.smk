# DDP training (torchrun): token blocks + serialized model -> final model folder, metrics, profile.
# Checkpoints live in results/train/checkpoints (not a declared output, so that a killed or
# restarted job resumes from them, and a job killed after its last checkpoint writes final/ from
# it without training); train.resume: never, or forcing the rule (--forcerun train), starts afresh.
rule train:
    input:
        cfg="results/config/train.json",
        tokens=rules.prepare_data.output.tokens,
        tokenizer=rules.prepare_data.output.tokenizer,
        model=rules.serialize_model.output.model,
    output:
        final=directory("results/train/final"),
        metrics="results/train/metrics.csv",
        val="results/train/val.csv",
        tb=directory("results/train/tb"),
        profile=directory("results/train/profile"),
    log:
        "logs/train/train.log",
    benchmark:
        "results/benchmarks/train.tsv"
    conda:
        "../envs/torch.yaml"
    threads: config["train"]["nproc_per_node"]
    params:
        sections=stage_sections("train"),
        script=entry_point("train.py"),
        nproc=config["train"]["nproc_per_node"],
        max_restarts=config["train"]["max_restarts"],
        out=lambda wildcards, output: str(Path(output.metrics).parent),
    shell:
        "{resources.torchrun} --nproc-per-node={params.nproc}"
        " --max-restarts={params.max_restarts} {params.script:q}"
        " --config {input.cfg:q} --tokens {input.tokens:q} --tokenizer {input.tokenizer:q}"
        " --model {input.model:q} --out {params.out:q}"
        " --rank-log 'logs/train/rank{{rank}}.log' > {log:q} 2>&1"


TARGETS["train"] = rules.train.output


def request_fresh_training():
    """A forced train job (--forcerun train, --forceall, -f on its outputs) is a request for a
    fresh run: leave one for the stage, which then discards its checkpoints. A plain rerun (after
    a kill, or a deleted output) leaves none and reuses them. Runs in the main Snakemake process
    only (onstart; never in a cluster job's inner Snakemake, which is forced by design).
    """
    from distlm.train.checkpoint import request_fresh_run

    if workflow.touch:
        return
    for job in workflow.dag.needrun_jobs():
        if job.rule.name == "train" and workflow.dag.reason(job).forced:
            out = Path(job.output.metrics).parent / "checkpoints"
            request_fresh_run(
                out, "Snakemake forced the train job (--forcerun, --forceall)"
            )


onstart:
    request_fresh_training()
