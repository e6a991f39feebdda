# Shared helpers: the typed settings, each stage's declared keys and outputs (src/distlm/dag/stages.py)
# and where each job variant writes them (src/distlm/dag/sweep.py).
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

# The workflow's own folder (its repository): this file's, two folders up. Not workflow.basedir:
# where distlm runs as a module of the user's own project (snakedeploy's layout, README "Deploy"),
# that is the project's. None when the module comes from a remote source (github(...)): then the
# library is the installed package, and the workflow reads nothing of its own folder by path.
_HERE = workflow.current_basedir
ROOT = (
    Path(_HERE.get_path_or_uri(secret_free=True)).parents[1] if _HERE.is_local else None
)
if ROOT is not None:
    sys.path.insert(0, str(ROOT / "src"))  # the library works from a plain checkout too

from distlm.dag.config import ConfigError
from distlm.launch.torchrun import stage_args
from distlm.runtime.machine import this_machine
from distlm.settings.ranks import machine_problems, stage_ranks
from distlm.settings.stage_configs import STAGE_CONFIGS, stage_params
from distlm.settings.validate import validate
from distlm.dag.stages import (
    BENCHMARKS,
    CONFIGS,
    EVAL_MODELS,
    JOBS,
    MODELS,
    STAGES,
    job_output,
)
from distlm.dag.sweep import VARIANT_PATTERN, plan_runs, variant_path
from distlm.data.documents import ID_CHARS
from distlm.data.sharding import DataPlans, Layout
from distlm import DistlmError

# The one validation (distlm.settings): errors name the key (and where an old key moved), --config
# strings become numbers, defaults are filled in. S is the typed settings; PLAN the runs of the
# config: one without a sweep, a distlm.dag.sweep.Plan with one (every run validated before any job
# starts). workflow/schemas/config.schema.yaml is generated from the same models, for editors and
# the report; it is no second gate.
try:
    _validated, S = validate(config, source="config")
    PLAN = plan_runs(S)
except ConfigError as e:
    raise WorkflowError(str(e))
config.clear()
config.update(_validated)
# The GPUs of this machine (no torch: distlm.runtime.machine). When the jobs run here (the local profile),
# a config the machine cannot run is refused before the first job, naming the key to change. It
# is an onstart handler: after the DAG is planned, and never in a dry run, which plans any config
# on any machine. Under SLURM the ranks check their own node (distlm.runtime.device).
MACHINE = this_machine()
GPUS = MACHINE.gpus


onstart:
    if workflow.is_main_process and workflow.local_exec:
        # a sweep's runs share most of the problems: each once
        problems = dict.fromkeys(
            p for s in PLAN.every_settings for p in machine_problems(s, MACHINE)
        )
        if problems:
            raise WorkflowError(
                f"this machine ({GPUS} GPU(s)) cannot run the config:\n  "
                + "\n  ".join(problems)
            )


# The {variant} of a job's paths: None without a sweep (today's paths), "{variant}" in a sweep,
# where every job's outputs and logs move under results/variants/{variant}/ and
# logs/variants/{variant}/, and its settings and inputs are those of its variant.
VARIANT = PLAN.variant


wildcard_constraints:
    stage="|".join(STAGES),
    model="|".join(EVAL_MODELS),
    variant=VARIANT_PATTERN,


def job_path(path, variant=VARIANT):
    """`path` (under results/ or logs/) as a job writes it: every output, log and benchmark path
    (distlm.dag.sweep.variant_path). The report and serve are whole-sweep jobs: variant=None.
    """
    return variant_path(path, variant)


def log_of(path):
    return job_path(path)


def per_job(fn):
    """fn(the typed settings of the job's run), for a rule's threads or params."""
    return lambda wildcards: fn(PLAN.settings_of(wildcards))


def torchrun_shell(entry, args, *, restarts=False, append_log=False):
    """A torch.distributed stage's shell command: the profile's launcher (resources.torchrun),
    its ranks (params.nproc), torchrun's restarts (params.max_restarts) when asked, the entry
    module `distlm.entry.<entry>` with its resolved config, `args` and its per-rank logs, and the
    rule's log (appended to with `append_log`). Built by distlm.launch.torchrun.stage_args.
    """
    argv = stage_args(
        entry,
        nproc="{params.nproc}",
        max_restarts="{params.max_restarts}" if restarts else None,
        args=["--config", "{input.cfg:q}", *args, "--rank-log", "{params.rank_log:q}"],
    )
    return " ".join(
        ["{resources.torchrun}", *argv, ">>" if append_log else ">", "{log:q} 2>&1"]
    )


def ranks_of(stage):
    """torchrun's --nproc-per-node of a torch.distributed stage: the count, or "gpu" (one rank
    per GPU of the node it runs on); distlm.settings.ranks."""
    return per_job(lambda s: stage_ranks(s, stage).per_node)


def threads_of(stage):
    """A torch.distributed stage's `threads`: its ranks on this machine."""
    return per_job(lambda s: stage_ranks(s, stage).threads(GPUS))


def params_of(stage):
    """Exactly the config keys `stage` reads, from its typed stage config (distlm.settings.stage_configs)
    of the job's run: a rule's params, so an edit of any other key leaves the rule's outputs
    cached."""
    return per_job(lambda s: stage_params(s, stage))


def inputs_of(stage, variant=VARIANT, model=None):
    """A stage's inputs, named, as distlm.dag.stages declares what it reads (`Stage.reads`): each
    another job's output, of the variant of that job this job's variant was derived from (the
    whole-sweep jobs, variant None: the paths without a sweep); "{model}" is the model folder of
    the job's {model} wildcard, or of `model` when given (serve.model for serve_shard)
    (distlm.dag.stages.MODELS)."""

    def one(job, output):
        def path(wc):
            j, out = MODELS[model or wc.model] if job == "{model}" else (job, output)
            return variant_path(job_output(j, out), variant and PLAN.upstream(wc, j))

        return path

    return {name: one(job, out) for name, (job, out) in STAGES[stage].reads.items()}


def outputs_of(stage, variant=VARIANT, **wildcards):
    """A stage's declared outputs, named, with directory() where the output is a folder."""
    s = STAGES[stage]
    return {
        name: (directory if out.directory else str)(
            job_path(s.path(name, **wildcards), variant)
        )
        for name, out in s.outputs.items()
    }


def targets_of(jobs):
    """Every output of every variant of `jobs`: what `rule all` and the report ask for."""
    return [
        path
        for job in jobs
        for out in STAGES[JOBS[job][0]].outputs
        for path in PLAN.targets(job, out)
    ]


def resolved_config(stage):
    """The resolved config file a multi-process stage reads (rule resolve_config writes it)."""
    return job_path(f"{CONFIGS}/{stage}.json")


def tracked_path(path):
    """`path` relative to the working directory when it lies there or in the checkout, so that no
    tracked input or param holds an absolute path that a moved project would change; a path
    elsewhere (the user's own absolute path) stays as it is."""
    path = Path(path).resolve()
    for base in (Path.cwd().resolve(), *([ROOT.resolve()] if ROOT else [])):
        if path.is_relative_to(base):
            return os.path.relpath(path)
    return str(path)


def benchmark_of(job, variant=VARIANT):
    return job_path(f"{BENCHMARKS}/{job}.tsv", variant)


def rank_log(path):
    """The per-rank log path a multi-process stage fills `{rank}` into, as the job writes it: a
    param (a function, so Snakemake fills the job's wildcards and leaves `{rank}`)."""
    return lambda wildcards: job_path(path).format(
        rank="{rank}", **dict(wildcards.items())
    )


# The data stage as the workflow sees it (distlm.data.sharding.DataPlans): each run's plan of
# shards and tokenizer, the gather's inputs, each job's spec by id (workflow/rules/data.smk).
DATA = DataPlans(
    Layout(
        shards=STAGES["data"].scratch_path("shards"),
        tokenizers=STAGES["data"].scratch_path("tokenizers"),
        listings=STAGES["data"].scratch_path("hub"),
    ),
    lambda: PLAN.every_settings,
    dry_run=lambda: workflow.dryrun,
)


wildcard_constraints:
    shard=f"[0-9a-f]{{{ID_CHARS}}}",
    tokenizer=f"[0-9a-f]{{{ID_CHARS}}}",


def data_inputs(wildcards):
    """The gather's inputs (DataPlans.inputs): the tokenizer folder and the shard files. A
    corpus that cannot be planned (a file missing, a hub data set that cannot be listed) stops
    the run before any job, naming the key."""
    s = PLAN.settings_of(wildcards)
    out = {
        k: str(p).format(**dict(wildcards.items()))
        for k, p in outputs_of("data").items()
    }
    try:
        inputs = DATA.inputs(s.data, s.model, tokens=out["tokens"], stats=out["stats"])
    except DistlmError as e:
        raise WorkflowError(str(e))
    for note in DATA.notes:
        logger.warning(note)
    DATA.notes.clear()
    return inputs
