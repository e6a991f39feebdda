"""Write the config keys a multi-process stage reads, as its typed stage config document
(distlm.settings.stage_configs), for all its ranks (rule resolve_config)."""

from distlm.core.log import get_logger, setup_logging
from distlm.settings.stage_configs import write_stage_config

snakemake = snakemake
setup_logging(snakemake.log[0])
stage = snakemake.wildcards.stage
digest = write_stage_config(stage, snakemake.params.cfg, snakemake.output[0])
get_logger("config").info("wrote %s (stage %s, digest %s)", snakemake.output[0], stage, digest[:12])
