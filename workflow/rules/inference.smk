# Pipeline-parallel inference (MPI, one rank per stage) on the trained checkpoint's stage shards:
# prompts -> generations JSONL + timing JSON. `rule serve` (outside rule all) runs the same
# pipeline behind an OpenAI-compatible HTTP server (workflow/rules/serve.smk).
from distlm.inference.prompts import resolve_prompts_path


rule inference:
    input:
        cfg="results/config/inference.json",
        model=rules.train.output.final,
        # relative to the working directory first, then the repository root
        prompts=lambda wc: str(
            resolve_prompts_path(config["inference"]["prompts"], ROOT)
        ),
    output:
        generations="results/inference/generations.jsonl",
        timing="results/inference/timing.json",
    log:
        "logs/inference/infer.log",
    benchmark:
        "results/benchmarks/inference.tsv"
    conda:
        "../envs/mpi.yaml"
    threads: config["inference"]["stages"]
    params:
        sections=stage_sections("inference"),
        script=entry_point("infer.py"),
        stages=config["inference"]["stages"],
    shell:
        "{resources.mpi} -n {params.stages} python {params.script:q} --config {input.cfg:q}"
        " --model {input.model:q} --prompts {input.prompts:q}"
        " --generations {output.generations:q} --timing {output.timing:q} > {log:q} 2>&1"


TARGETS["inference"] = rules.inference.output

