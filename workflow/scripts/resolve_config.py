"""Write the resolved config sections a multi-process stage reads (rule resolve_config)."""

from distlm.config import write_resolved
from distlm.log import get_logger, setup_logging

snakemake = snakemake  # noqa: F821  (injected by Snakemake)
setup_logging(snakemake.log[0])
sections = snakemake.params.sections
digest = write_resolved(sections, sections.keys(), snakemake.output[0])
get_logger("config").info("wrote %s (sections %s, digest %s)", snakemake.output[0], list(sections), digest[:12])
