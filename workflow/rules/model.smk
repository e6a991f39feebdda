rule serialize_model:
    input:
        tokens=rules.prepare_data.output.tokens,
        tokenizer=rules.prepare_data.output.tokenizer,
    output:
        model=directory("results/model/base"),
    log:
        "logs/model/serialize.log",
    benchmark:
        "results/benchmarks/serialize_model.tsv"
    conda:
        "../envs/torch.yaml"
    threads: 2
    params:
        sections=stage_sections("model"),
    script:
        "../scripts/serialize_model.py"


TARGETS["model"] = rules.serialize_model.output
