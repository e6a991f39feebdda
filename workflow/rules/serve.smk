# Serve mode (not in rule all): the pipeline of rule inference behind an OpenAI-compatible API
# server, in the foreground until interrupted: `snakemake --profile profiles/local serve`.
rule serve:
    input:
        cfg=resolved_config("serve"),
        model=STAGES["shard"].path("pipeline", model="trained"),
    log:
        "logs/inference/serve.log",
    conda:
        "../envs/serve.yaml"
    threads: config["inference"]["stages"]
    params:
        script=entry_point("serve.py"),
        cfg=params_of("serve"),
        stages=config["inference"]["stages"],
    shell:
        # The API server (this process, uvicorn) starts the MPI job with the profile's launcher and
        # talks to stage 0 over ZeroMQ; it answers 503 when the job dies
        # (src/distlm/inference/supervisor.py).
        "python {params.script:q} --launcher '{resources.mpi} -n {params.stages}'"
        " --config {input.cfg:q} --model {input.model:q} 2>&1 | tee {log:q}"
