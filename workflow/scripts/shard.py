"""Pipeline shards: a model folder -> one safetensors shard per pipeline stage (rules shard and
serve_shard: their stage configs, ShardConfig and ServeShardConfig, give the stage count)."""

from distlm.core.log import setup_logging
from distlm.model import write_pipeline_dir
from distlm.settings.model import ServeShardConfig, ShardConfig

snakemake = snakemake
setup_logging(snakemake.log[0])
config = {"shard": ShardConfig, "serve_shard": ServeShardConfig}[snakemake.rule]
write_pipeline_dir(
    snakemake.input.model,
    snakemake.output.pipeline,
    stages=config.of(snakemake.params.cfg).stages,
)
