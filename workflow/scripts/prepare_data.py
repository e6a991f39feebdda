"""Dataset prep's gather: the token shards -> the index (tokens.h5), the tokenizer beside it, the
stats JSON (rule prepare_data)."""

from distlm.core.log import setup_logging
from distlm.data import gather
from distlm.settings.data import DataConfig

snakemake = snakemake
setup_logging(snakemake.log[0])
cfg = DataConfig.of(snakemake.params.cfg)
gather(
    cfg.data,
    cfg.model,
    tokenizer_src=snakemake.input.get("tokenizer", ""),
    tokenizer_info=snakemake.input.get("tokenizer_info", ""),
    shard_paths=list(snakemake.input.get("shards", [])),
    tokens_path=snakemake.output.tokens,
    tokenizer_dir=snakemake.output.tokenizer,
    stats_path=snakemake.output.stats,
)
