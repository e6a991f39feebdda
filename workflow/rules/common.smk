# Shared helpers: config validation, each stage's declared keys and outputs (src/distlm/stages.py).
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

ROOT = Path(workflow.basedir)
sys.path.insert(0, str(ROOT / "src"))  # the library works from a plain checkout too

from distlm.config import ConfigError, validate_config
from distlm.stages import BENCHMARKS, CONFIGS, EVAL_MODELS, STAGES, stage_config

# The models (distlm.settings) validate first: their errors name the key (and where an old key
# moved), and they turn --config strings into numbers. Snakemake's own validate then checks the
# result against the schema generated from them (workflow/schemas/config.schema.yaml).
try:
    _validated = validate_config(config, source="config")
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)
validate(config, "../schemas/config.schema.yaml")


wildcard_constraints:
    stage="|".join(STAGES),
    model="|".join(EVAL_MODELS),


def params_of(stage):
    """Exactly the config keys `stage` reads: a rule's params, so an edit of any other key
    leaves the rule's outputs cached."""
    return stage_config(config, stage)


def outputs_of(stage, **wildcards):
    """A stage's declared outputs, named, with directory() where the output is a folder."""
    s = STAGES[stage]
    return {
        name: (
            directory(s.path(name, **wildcards))
            if out.directory
            else s.path(name, **wildcards)
        )
        for name, out in s.outputs.items()
    }


def resolved_config(stage):
    """The resolved config file a multi-process stage reads (rule resolve_config writes it)."""
    return f"{CONFIGS}/{stage}.json"


def tracked_path(path):
    """`path` relative to the working directory when it lies there or in the checkout, so that no
    tracked input or param holds an absolute path that a moved project would change; a path
    elsewhere (the user's own absolute path) stays as it is."""
    path = Path(path).resolve()
    for base in (Path.cwd().resolve(), ROOT.resolve()):
        if path.is_relative_to(base):
            return os.path.relpath(path)
    return str(path)


def benchmark_of(job):
    return f"{BENCHMARKS}/{job}.tsv"


def entry_point(name):
    """A stage entry point that a launcher starts (a rule's `script` param): its absolute path,
    as a param derived from the job's input. Snakemake leaves params derived from input or output
    out of its params trigger (the input trigger covers them), so no tracked value holds this
    path, and a moved or re-cloned project (or another --directory) reruns nothing.
    """
    path = str(ROOT / "workflow" / "scripts" / name)
    return lambda wildcards, input: path
