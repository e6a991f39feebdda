# Checkpoint evaluation: sliding-window perplexity of the base and the trained model (torchrun).
EVAL_MODELS = {"base": rules.serialize_model.output.model}
if "train" in TARGETS:  # TEMPORARY until the train stage is merged: then always add "trained"
    EVAL_MODELS["trained"] = "results/train/final"


wildcard_constraints:
    model="|".join(EVAL_MODELS),


rule evaluate:
    input:
        cfg="results/config/eval.json",
        tokens=rules.prepare_data.output.tokens,
        model=lambda wc: EVAL_MODELS[wc.model],
    output:
        json="results/eval/{model}.json",
    params:
        sections=stage_sections("eval"),
        script=entry_point("evaluate.py"),
        nproc=config["eval"]["nproc_per_node"],
    log:
        "logs/eval/{model}.log",
    benchmark:
        "results/benchmarks/evaluate_{model}.tsv"
    threads: config["eval"]["nproc_per_node"]
    conda:
        "../envs/torch.yaml"
    shell:
        "{resources.torchrun} --nproc-per-node={params.nproc} {params.script}"
        " --config {input.cfg} --model {input.model} --tokens {input.tokens}"
        " --name {wildcards.model} --out {output.json} > {log} 2>&1"


TARGETS["eval"] = expand(rules.evaluate.output.json, model=EVAL_MODELS)
