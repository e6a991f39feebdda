# DDP training (torchrun): token blocks + serialized model -> final model folder, metrics, profile.
# Checkpoints live in results/train/checkpoints (not a declared output, so that a killed or
# restarted job resumes from them); train.resume: never starts afresh.
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
        " --max-restarts={params.max_restarts} {params.script}"
        " --config {input.cfg} --tokens {input.tokens} --tokenizer {input.tokenizer}"
        " --model {input.model} --out {params.out}"
        " --rank-log 'logs/train/rank{{rank}}.log' > {log} 2>&1"


TARGETS["train"] = rules.train.output
