rule serialize_model:
    input:
        tokens=rules.prepare_data.output.tokens,
        tokenizer=rules.prepare_data.output.tokenizer,
    output:
        model=directory("results/model/base"),
    params:
        sections=stage_sections("model"),
    log:
        "logs/model/serialize.log",
    benchmark:
        "results/benchmarks/serialize_model.tsv"
    threads: 2
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/serialize_model.py"


TARGETS["model"] = rules.serialize_model.output
