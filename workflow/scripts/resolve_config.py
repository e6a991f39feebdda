"""Write the config keys a multi-process stage reads, for all its ranks (rule resolve_config)."""

from distlm.config import write_resolved
from distlm.log import get_logger, setup_logging

snakemake = snakemake
setup_logging(snakemake.log[0])
digest = write_resolved(snakemake.params.cfg, snakemake.output[0])
get_logger("config").info(
    "wrote %s (stage %s, digest %s)", snakemake.output[0], snakemake.wildcards.stage, digest[:12]
)
