# Serve mode (not in rule all): the pipeline of rule inference behind an OpenAI-compatible HTTP
# server, in the foreground until interrupted: `snakemake --profile profiles/local serve`.
rule serve:
    input:
        cfg=resolved_config("inference"),
        model=STAGES["shard"].path("pipeline", model="trained"),
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
        "python {params.script:q} --launcher '{resources.mpi} -n {params.stages}'"
        " --config {input.cfg:q} --model {input.model:q} 2>&1 | tee {log:q}"
