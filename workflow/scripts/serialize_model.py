"""Model download/serialize: hub id, local folder or seeded init -> model folder (rule serialize_model)."""

from pathlib import Path

from distlm.core.log import setup_logging
from distlm.model import serialize
from distlm.settings.model import ModelConfig

snakemake = snakemake
setup_logging(snakemake.log[0])
serialize(
    ModelConfig.of(snakemake.params.cfg),
    tokenizer_dir=Path(snakemake.input.tokenizer),
    tokens_path=Path(snakemake.input.tokens),
    out_dir=Path(snakemake.output.model),
)
