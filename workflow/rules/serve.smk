# Serve mode (not in rule all): the trained model behind an OpenAI-compatible API server, in the
# foreground until interrupted: `snakemake --profile profiles/local serve`. It has its own shards
# (serve.stages; 1 serves best on one machine), so neither stage count re-cuts the other's.
rule serve_shard:
    input:
        model=MODEL_FOLDERS["trained"],
    output:
        **outputs_of("serve_shard"),
    log:
        "logs/serve/shard.log",
    benchmark:
        benchmark_of("serve_shard")
    conda:
        "../envs/torch.yaml"
    threads: 1
    params:
        cfg=params_of("serve_shard"),
        stages=config["serve"]["stages"],
    script:
        "../scripts/shard.py"


rule serve:
    input:
        cfg=resolved_config("serve"),
        model=STAGES["serve_shard"].path("pipeline"),
    log:
        "logs/inference/serve.log",
    conda:
        "../envs/serve.yaml"
    threads: config["serve"]["stages"]
    params:
        script=entry_point("serve.py"),
        cfg=params_of("serve"),
        stages=config["serve"]["stages"],
    shell:
        # The API server (this process, uvicorn) starts the MPI job with the profile's launcher and
        # talks to stage 0 over ZeroMQ; it answers 503 when the job dies
        # (src/distlm/inference/server/supervisor.py).
        "python {params.script:q} --launcher '{resources.mpi} -n {params.stages}'"
        " --config {input.cfg:q} --model {input.model:q} 2>&1 | tee {log:q}"
