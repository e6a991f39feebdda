# Shared helpers: config validation, each stage's declared keys and outputs (src/distlm/stages.py).
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

ROOT = Path(workflow.basedir)
sys.path.insert(0, str(ROOT / "src"))  # the library works from a plain checkout too

from distlm.config import ConfigError, validate_config
from distlm.settings.stage import STAGE_CONFIGS
from distlm.stages import BENCHMARKS, CONFIGS, EVAL_MODELS, JOBS, STAGES, stage_config
from distlm.sweep import VARIANT_PATTERN, plan_sweep, split_job, variant_path

# The models (distlm.settings) validate first: their errors name the key (and where an old key
# moved), and they turn --config strings into numbers. Snakemake's own validate then checks the
# result against the schema generated from them (workflow/schemas/config.schema.yaml).
try:
    _validated = validate_config(config, source="config")
    # A sweep (docs/sweeps.md): every run validated before any job starts; None without one.
    SWEEP = plan_sweep(_validated, source="config")
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)
validate(config, "../schemas/config.schema.yaml")


wildcard_constraints:
    stage="|".join(STAGES),
    model="|".join(EVAL_MODELS),
    variant=VARIANT_PATTERN,


def params_of(stage):
    """Exactly the config keys `stage` reads: a rule's params, so an edit of any other key
    leaves the rule's outputs cached. In a sweep, those of the job variant's run."""
    if SWEEP:
        return lambda wildcards: stage_config(SWEEP.config_of(wildcards.variant), stage)
    return stage_config(config, stage)


# ----------------------------------------------------------------------------- sweeps
# Without a sweep each helper below returns exactly what the rules held before sweeps existed
# (paths, values), so a config without `sweep` keeps its commands, paths and cache. In a sweep
# every job has a {variant} wildcard (distlm.sweep): its outputs and logs move under
# results/variants/{variant}/ and logs/variants/{variant}/, and its settings and inputs are
# those of its variant.


def config_of(wildcards):
    """The config a job reads: the run config of its variant in a sweep, else the config."""
    return SWEEP.config_of(wildcards.variant) if SWEEP else config


def in_variant(path):
    """`path` (under results/ or logs/) as a job variant writes it in a sweep."""
    return variant_path(path, "{variant}") if SWEEP else path


def log_of(path):
    return in_variant(path)


def setting(key, fn=lambda v: v):
    """fn(the value of dotted config `key`) for a rule's threads or params."""

    def get(cfg):
        for part in key.split("."):
            cfg = cfg[part]
        return fn(cfg)

    if SWEEP:
        return lambda wildcards: get(SWEEP.config_of(wildcards.variant))
    return get(config)


def upstream(job, output):
    """Output `output` of job `job` (distlm.stages.JOBS), an input of the job that consumes it;
    in a sweep, of the variant of `job` that the consuming job's variant was derived from.
    """
    _, wildcards = split_job(job)
    path = STAGES[JOBS[job][0]].path(output, **wildcards)
    if SWEEP:
        return lambda wc: variant_path(path, SWEEP.upstream(wc.variant, job))
    return path


def model_folder(wildcards):
    """The model folder of {model} (MODEL_FOLDERS, model.smk); in a sweep, of the variant that
    this job variant consumes."""
    path = MODEL_FOLDERS[wildcards.model]
    if SWEEP:
        return variant_path(
            path, SWEEP.upstream(wildcards.variant, MODEL_JOBS[wildcards.model])
        )
    return path


def run_labels(run, **labels):
    """report() labels of a sweep run's output: the run and its values of the varied keys, so
    `snakemake --report` lets one switch between runs."""
    varied = SWEEP_DESCRIPTION.runs[run].varied
    return {"run": run, **{k: str(v) for k, v in varied.items()}, **labels}


def sweep_shell(cmd):
    """A shell command whose quoted 'logs/...' paths (rank logs) move with the job variant."""
    return (
        cmd.replace("'logs/", "'logs/variants/{wildcards.variant}/") if SWEEP else cmd
    )


def outputs_of(stage, **wildcards):
    """A stage's declared outputs, named, with directory() where the output is a folder."""
    s = STAGES[stage]
    return {
        name: (
            directory(in_variant(s.path(name, **wildcards)))
            if out.directory
            else in_variant(s.path(name, **wildcards))
        )
        for name, out in s.outputs.items()
    }


def resolved_config(stage):
    """The resolved config file a multi-process stage reads (rule resolve_config writes it)."""
    return in_variant(f"{CONFIGS}/{stage}.json")


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
    return in_variant(f"{BENCHMARKS}/{job}.tsv")


def entry_point(name):
    """A stage entry point that a launcher starts (a rule's `script` param): its absolute path,
    as a param derived from the job's input. Snakemake leaves params derived from input or output
    out of its params trigger (the input trigger covers them), so no tracked value holds this
    path, and a moved or re-cloned project (or another --directory) reruns nothing.
    """
    path = str(ROOT / "workflow" / "scripts" / name)
    return lambda wildcards, input: path
