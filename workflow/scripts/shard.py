"""Pipeline shards: a model folder -> one safetensors shard per pipeline stage (rule shard)."""

from distlm.log import setup_logging
from distlm.model import write_pipeline_dir
from distlm.settings.stage import ShardConfig

snakemake = snakemake
setup_logging(snakemake.log[0])
write_pipeline_dir(
    snakemake.input.model,
    snakemake.output.pipeline,
    stages=ShardConfig.of(snakemake.params.cfg).inference.stages,
)
