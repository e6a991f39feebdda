# Pipeline-parallel inference (MPI, one rank per stage) on the trained checkpoint's stage shards:
# prompts -> generations JSONL + timing JSON. `rule serve` (outside rule all) runs the same
# pipeline behind an OpenAI-compatible HTTP server: `snakemake --profile profiles/local serve`.
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
        "{resources.mpi} -n {params.stages} python {params.script} --config {input.cfg}"
        " --model {input.model} --prompts {input.prompts}"
        " --generations {output.generations} --timing {output.timing} > {log} 2>&1"


TARGETS["inference"] = rules.inference.output


# Not part of rule all: runs in the foreground until interrupted (Ctrl-C or SIGTERM).
rule serve:
    input:
        cfg="results/config/inference.json",
        model=rules.train.output.final,
    log:
        "logs/inference/serve.log",
    conda:
        "../envs/mpi.yaml"
    threads: config["inference"]["stages"]
    params:
        script=entry_point("serve.py"),
        stages=config["inference"]["stages"],
    shell:
        # The front (this process) serves HTTP and starts the MPI job with the profile's launcher;
        # it answers 503 when the job dies (src/distlm/inference/front.py).
        "python {params.script} --launcher '{resources.mpi} -n {params.stages}'"
        " --config {input.cfg} --model {input.model} 2>&1 | tee {log}"
