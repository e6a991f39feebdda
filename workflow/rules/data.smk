# Dataset prep: corpus -> tokenizer, HDF5 token blocks per split, stats JSON.
rule prepare_data:
    output:
        **outputs_of("data"),
    log:
        log_of("logs/data/prepare.log"),
    benchmark:
        benchmark_of("prepare_data")
    conda:
        "../envs/data.yaml"
    threads: 2
    params:
        cfg=params_of("data"),
    script:
        "../scripts/prepare_data.py"
