# Pipeline-parallel inference (MPI, one rank per stage) on the trained model's stage shards:
# prompts -> generations JSONL + timing JSON. `rule serve` (outside rule all) runs the same
# pipeline behind an OpenAI-compatible HTTP server (workflow/rules/serve.smk).
from distlm.inference.prompts import resolve_prompts_path


rule inference:
    input:
        **inputs_of("inference"),
        cfg=resolved_config("inference"),
        # relative to the working directory first, then the repository root
        prompts=lambda wc: tracked_path(
            resolve_prompts_path(PLAN.settings_of(wc).inference.prompts, ROOT)
        ),
    output:
        **outputs_of("inference"),
    log:
        log_of("logs/inference/infer.log"),
    benchmark:
        benchmark_of("inference")
    conda:
        "../envs/mpi.yaml"
    threads: per_job(lambda s: s.inference.stages)
    resources:
        tasks=per_job(lambda s: s.inference.stages),  # SLURM's: one MPI rank per stage
    params:
        cfg=params_of("inference"),
        stages=per_job(lambda s: s.inference.stages),
    shell:
        "{resources.mpi} -n {params.stages} python -m distlm.entry.infer --config {input.cfg:q}"
        " --model {input.model:q} --prompts {input.prompts:q}"
        " --generations {output.generations:q} --timing {output.timing:q} > {log:q} 2>&1"
