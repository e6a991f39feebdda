"""Dataset prep: a hub data set's listing (its data files, sizes and row groups), kept for the
plan of its shards (checkpoint data_listing)."""

from distlm.core.log import get_logger, setup_logging
from distlm.data.sharding import write_listing
from distlm.settings.data import DataHubSettings

snakemake = snakemake
setup_logging(snakemake.log[0])
hub = DataHubSettings.model_validate(snakemake.params.hub)
write_listing(hub, snakemake.params.text_field, snakemake.output.listing)
get_logger("data").info(
    "listed data.hub %r (%s) into %s", hub.path, hub.name, snakemake.output.listing
)
