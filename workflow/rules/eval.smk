# Checkpoint evaluation (torchrun): sliding-window perplexity of the serialized base model and of
# the final training checkpoint, every split in eval.splits, one JSON per model.
EVAL_MODELS = {
    "base": rules.serialize_model.output.model,
    "trained": rules.train.output.final,
}


rule evaluate:
    input:
        cfg="results/config/eval.json",
        tokens=rules.prepare_data.output.tokens,
        model=lambda wc: EVAL_MODELS[wc.model],
    output:
        json="results/eval/{model}.json",
    log:
        "logs/eval/{model}.log",
    benchmark:
        "results/benchmarks/evaluate_{model}.tsv"
    wildcard_constraints:
        model="|".join(EVAL_MODELS),
    conda:
        "../envs/torch.yaml"
    threads: config["eval"]["nproc_per_node"]
    params:
        sections=stage_sections("eval"),
        script=entry_point("evaluate.py"),
        nproc=config["eval"]["nproc_per_node"],
    shell:
        "{resources.torchrun} --nproc-per-node={params.nproc} {params.script:q}"
        " --config {input.cfg:q} --model {input.model:q} --tokens {input.tokens:q}"
        " --name {wildcards.model} --out {output.json:q}"
        " --rank-log 'logs/eval/{wildcards.model}.rank{{rank}}.log' > {log:q} 2>&1"


TARGETS["eval"] = expand(rules.evaluate.output.json, model=EVAL_MODELS)
