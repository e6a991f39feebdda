"""Model download/serialize: hub id, local folder or seeded init -> model folder + stage shards."""

from pathlib import Path

from distlm.log import setup_logging
from distlm.model import serialize

snakemake = snakemake  # noqa: F821  (injected by Snakemake)
setup_logging(snakemake.log[0])
serialize(
    snakemake.config,
    tokens_path=Path(snakemake.input.tokens),
    tokenizer_dir=Path(snakemake.input.tokenizer),
    out_dir=Path(snakemake.output.model),
)
