"""Dataset prep: one shard of the corpus -> its token shard file (rule tokenize_shard)."""

from distlm.core.log import setup_logging
from distlm.data import tokenize_shard
from distlm.data.documents import ShardSpec

snakemake = snakemake
setup_logging(snakemake.log[0])
tokenize_shard(
    ShardSpec.from_json(snakemake.params.spec, "rule tokenize_shard's params"),
    tokenizer_dir=snakemake.input.tokenizer,
    out_path=snakemake.output.shard,
    threads=snakemake.threads,
)
