"""Dataset prep: corpus -> tokenizer, HDF5 token blocks, stats JSON (rule prepare_data)."""

from distlm.core.log import setup_logging
from distlm.data import prepare
from distlm.settings.data import DataConfig

snakemake = snakemake
setup_logging(snakemake.log[0])
cfg = DataConfig.of(snakemake.params.cfg)
prepare(
    cfg.data,
    cfg.model,
    tokens_path=snakemake.output.tokens,
    tokenizer_dir=snakemake.output.tokenizer,
    stats_path=snakemake.output.stats,
)
