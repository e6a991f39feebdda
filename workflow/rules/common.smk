# Shared helpers: config validation, each stage's declared keys and outputs (src/distlm/stages.py).
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

ROOT = Path(workflow.basedir)
sys.path.insert(0, str(ROOT / "src"))  # the library works from a plain checkout too

from distlm.config import ConfigError, validate_config
from distlm.stages import BENCHMARKS, CONFIGS, EVAL_MODELS, STAGES, stage_config

try:
    _validated = validate_config(config, source="config")
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)


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


def benchmark_of(job):
    return f"{BENCHMARKS}/{job}.tsv"


def entry_point(name):
    """Absolute path of a stage entry point, for rules that start it through a launcher."""
    return str(ROOT / "workflow" / "scripts" / name)


def request_fresh_training():
    """A forced train job (--forcerun train, --forceall, -f on its outputs) is a request for a
    fresh run: leave one for the stage, which then discards its checkpoints. A plain rerun (after
    a kill, or a deleted output) leaves none and reuses them. Runs in the main Snakemake process
    only (onstart; never in a cluster job's inner Snakemake, which is forced by design).
    """
    from distlm.train.checkpoint import request_fresh_run

    if workflow.touch:
        return
    for job in workflow.dag.needrun_jobs():
        if job.rule.name == "train" and workflow.dag.reason(job).forced:
            out = Path(STAGES["train"].dir) / STAGES["train"].scratch["checkpoints"]
            request_fresh_run(
                out, "Snakemake forced the train job (--forcerun, --forceall)"
            )
