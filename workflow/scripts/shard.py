"""Pipeline shards: a model folder -> one safetensors shard per pipeline stage (rules shard and
serve_shard; params.stages is inference.stages or serve.stages)."""

from distlm.log import setup_logging
from distlm.model import write_pipeline_dir

snakemake = snakemake
setup_logging(snakemake.log[0])
write_pipeline_dir(
    snakemake.input.model,
    snakemake.output.pipeline,
    stages=snakemake.params.stages,
)
