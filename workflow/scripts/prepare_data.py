"""Dataset prep: corpus -> tokenizer, HDF5 token blocks, stats JSON (rule prepare_data)."""

from distlm.data import prepare
from distlm.log import setup_logging

snakemake = snakemake
setup_logging(snakemake.log[0])
prepare(
    snakemake.params.cfg,
    tokens_path=snakemake.output.tokens,
    tokenizer_dir=snakemake.output.tokenizer,
    stats_path=snakemake.output.stats,
)
