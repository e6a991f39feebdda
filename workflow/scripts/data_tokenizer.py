"""Dataset prep: the tokenizer the shards are tokenized with (rule data_tokenizer)."""

from distlm.core.log import setup_logging
from distlm.data import make_tokenizer
from distlm.data.documents import TokenizerSpec

snakemake = snakemake
setup_logging(snakemake.log[0])
make_tokenizer(
    TokenizerSpec.from_json(snakemake.params.spec, "rule data_tokenizer's params"),
    snakemake.output.tokenizer,
    snakemake.output.info,
)
