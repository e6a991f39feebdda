# Serve mode (not in rule all): the trained model (or the base one, serve.model) behind an
# OpenAI-compatible API server, in the foreground until interrupted:
# `snakemake --profile profiles/local serve`. It has its own shards (serve.stages; 1 serves best on
# one machine), so neither stage count re-cuts the other's. With serve.follow_training the server
# says where it listens (the stage's endpoint file) and takes each checkpoint the training run
# pushes (docs/serving.md, "Serve while training").
rule serve_shard:
    input:
        **inputs_of("serve_shard", variant=None, model=S.serve.model),
    output:
        **outputs_of("serve_shard", variant=None),
    log:
        job_path("logs/serve/shard.log", variant=None),
    benchmark:
        benchmark_of("serve_shard", variant=None)
    conda:
        "../envs/torch.yaml"
    threads: 1
    params:
        cfg=stage_params(S, "serve_shard"),
    script:
        "../scripts/shard.py"


rule serve:
    input:
        **inputs_of("serve", variant=None),
        cfg=job_path(f"{CONFIGS}/serve.json", variant=None),
    log:
        job_path("logs/inference/serve.log", variant=None),
    conda:
        "../envs/serve.yaml"
    # The job's processes: a rank per stage and the API server processes beside stage 0; the
    # ranks' intra-op threads share all of them (docs/serving.md, "Stage count"). SLURM's tasks
    # are the ranks alone.
    threads: S.serve.stages + S.serve.api_servers
    resources:
        tasks=S.serve.stages,
    params:
        cfg=stage_params(S, "serve"),
        stages=S.serve.stages,
        endpoint=job_path(STAGES["serve"].scratch_path("endpoint"), variant=None),
    shell:
        # The API server (this process, uvicorn) starts the MPI job with the profile's launcher and
        # talks to stage 0 over ZeroMQ; it answers 503 when the job dies
        # (src/distlm/inference/server/supervisor.py).
        "python -m distlm.entry.serve --launcher '{resources.mpi} -n {params.stages}'"
        " --config {input.cfg:q} --model {input.model:q} --endpoint {params.endpoint:q}"
        " 2>&1 | tee {log:q}"
