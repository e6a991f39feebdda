# Shared helpers: config validation, resolved per-stage configs, paths of every stage's outputs.
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

ROOT = Path(workflow.basedir)
sys.path.insert(0, str(ROOT / "src"))  # the library works from a plain checkout too

from distlm.config import ConfigError, sections, validate_config

try:
    _validated = validate_config(config, source="config")
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)

# The config sections each stage depends on: a change elsewhere does not rerun the stage.
STAGE_SECTIONS = {
    "data": ["data", "model"],
    "model": ["data", "model", "inference"],
    "broadcast": ["runtime", "broadcast"],
    "train": ["runtime", "data", "model", "broadcast", "train"],
    "eval": ["runtime", "data", "eval"],
    "inference": ["runtime", "inference"],
    "serve": ["runtime", "inference", "serve"],
    "report": ["report"],
}


wildcard_constraints:
    stage="|".join(STAGE_SECTIONS),


def stage_sections(stage):
    """The resolved config sections of a stage (a rule's params, so edits trigger a rerun)."""
    return sections(config, STAGE_SECTIONS[stage])


def entry_point(name):
    """Absolute path of a stage entry point, for rules that start it through a launcher."""
    return str(ROOT / "workflow" / "scripts" / name)


# Every stage adds its final outputs here; rule all asks for all of them.
TARGETS = {}


def all_targets():
    return [t for targets in TARGETS.values() for t in targets]
