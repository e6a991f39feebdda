"""Stage contracts: each stage of the DAG declared once, with the config keys it reads, the files
it writes and the document it reports.

    from distlm.dag.stages import STAGES, stage_config
    STAGES["train"].keys                   # ("runtime", "train", "transfer"): TrainConfig's fields
    STAGES["train"].path("final")          # "results/train/final"
    stage_config(cfg, "train")             # the validated config cut down to exactly those keys

This is the only table of the DAG: `rule all` (JOBS), the report's inputs (REPORT_READS), the
{model} folders (MODELS) and the sweep's job variants are derived from it. A stage's keys are the
fields of its typed document (`distlm.settings.stage_configs`: a stage that reads another key has
no field for it, so it never silently depends on it). The rules take their params (exactly a
stage's keys) and output paths from here, the trainer and the report's readers take the same
paths, and config/README.md's table "what reruns when you change a key" is generated from these
declarations (distlm.dag.tables: `python -m distlm.dag.tables --check` keeps it in sync). So a
change to a sampling setting reruns inference and the report, and never training.

This module imports nothing heavy: the workflow reads it while it builds the DAG.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

RESULTS = "results"
BENCHMARKS = f"{RESULTS}/benchmarks"  # Snakemake `benchmark:` TSVs, one per job, {job}.tsv
CONFIGS = f"{RESULTS}/config"  # resolved per-stage configs of multi-process stages, {stage}.json


@dataclass(frozen=True)
class Output:
    """One declared output of a stage: a path relative to the stage's folder under results/."""

    name: str  # relative to the stage folder; may hold {wildcards}
    directory: bool = False


@dataclass(frozen=True)
class Stage:
    """A stage of the DAG: its rule, the jobs it consumes and the files it writes. The config keys
    it reads are its typed stage config's fields (`distlm.settings.stage_configs`), never written
    here."""

    name: str
    rule: str
    folder: str  # under results/
    # Where its code lives, and how its rule starts it (docs/architecture.md's stage table is
    # generated from both). `home`: the package or module that holds the stage's logic; its
    # settings are its typed stage config (`keys` below). `commands`: the thin entry points the
    # rule runs, each only reading its inputs and calling into the home: a module a launcher
    # starts (`distlm.entry.<name>`, under torchrun or mpiexec) or a `script:` file that runs in
    # Snakemake's own process (workflow/scripts/). The rules name them in their own text;
    # tests/test_layout.py checks that each rule names its stage's commands and each command
    # imports its home.
    home: str
    commands: tuple[str, ...]
    outputs: Mapping[str, Output]
    # (output, type): the output holding the stage's report document and its distlm.core.documents type
    document: tuple[str, str] | None = None
    # what it reads of other jobs' outputs: its rule's input name -> (job, output); the job
    # "{model}" is the one that writes the {model} folder (MODELS), its output that folder. The
    # rule's inputs and the DAG's edges (`consumes`, JOBS) are derived from it.
    reads: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    instances: tuple[str, ...] = ()  # values of its {model} wildcard in `rule all`; () = one job
    in_all: bool = True  # a job of `rule all` (serve and its shards are started by name)
    scratch: Mapping[str, str] = field(default_factory=dict)  # undeclared working folders
    # The stage's other rules, each with its commands: jobs that its rule's job consumes and no
    # other stage sees, writing into its scratch folders (the data stage's tokenizer and shards)
    parts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def consumes(self) -> tuple[str, ...]:
        """The jobs whose outputs it reads (JOBS' edges), in the order of `reads`."""
        return tuple(dict.fromkeys(job for job, _ in self.reads.values()))

    @property
    def keys(self) -> tuple[str, ...]:
        """Dotted config keys it reads (a key covers everything under it): its stage config's."""
        from distlm.settings.stage_configs import stage_keys

        return stage_keys(self.name)

    @property
    def jobs(self) -> tuple[str, ...]:
        """Its jobs: the rule, or rule[model] for each instance."""
        return tuple(f"{self.rule}[{m}]" for m in self.instances) or (self.rule,)

    @property
    def dir(self) -> str:
        """The stage's folder relative to the working directory (results/<folder>)."""
        return f"{RESULTS}/{self.folder}"

    def path(self, output: str, **wildcards: str) -> str:
        """Path of a declared output relative to the working directory (results/...)."""
        name = self.outputs[output].name
        return f"{self.dir}/{name.format(**wildcards) if wildcards else name}"

    def relpath(self, output: str, **wildcards: str) -> str:
        """Path of a declared output relative to results/ (what the report's readers take)."""
        return self.path(output, **wildcards)[len(RESULTS) + 1 :]

    def file(self, output: str) -> str:
        """File name of an output inside the stage folder (what code given that folder joins)."""
        return self.outputs[output].name

    def scratch_path(self, name: str) -> str:
        """Path of an undeclared working file or folder of the stage (results/...)."""
        return f"{RESULTS}/{self.folder}/{self.scratch[name]}"

    def covers(self, key: str) -> bool:
        """Whether this stage reads dotted config key `key` (or a key under it)."""
        return any(key == k or key.startswith(k + ".") for k in self.keys)


def _outputs(**outs: str | tuple[str, bool]) -> dict[str, Output]:
    return {k: Output(*v) if isinstance(v, tuple) else Output(v) for k, v in outs.items()}


# The model folders of the {model} wildcard (the evaluate and shard rules): the job and output.
MODELS: dict[str, tuple[str, str]] = {
    "base": ("serialize_model", "model"),
    "trained": ("train", "final"),
}
EVAL_MODELS = tuple(MODELS)

# What the report reads: its input name -> (job, output). The report's own folder and its readers
# (distlm.report.inputs.LAYOUT, a sweep run's layout) and the report job's inputs come from here.
REPORT_READS: dict[str, tuple[str, str]] = {
    "stats": ("prepare_data", "stats"),
    "broadcast": ("broadcast", "report"),
    "metrics": ("train", "metrics"),
    "val": ("train", "val"),
    "profile": ("train", "profile"),
    "eval_base": ("evaluate[base]", "json"),
    "eval_trained": ("evaluate[trained]", "json"),
    "timing": ("inference", "timing"),
    "generations": ("inference", "generations"),
}

# The stages in the order of `rule all` (and of JOBS).
STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        # corpus -> tokenizer, HDF5 token shards behind one index (per split), stats: a tokenizer
        # job and one tokenize job per shard (distlm.data.sharding), then prepare_data gathers them
        Stage(
            "data",
            "prepare_data",
            "data",
            home="distlm.data",
            commands=("workflow/scripts/prepare_data.py",),
            outputs=_outputs(tokens="tokens.h5", tokenizer=("tokenizer", True), stats="stats.json"),
            document=("stats", "DataStats"),
            # shards: one file per shard (<id>.h5), tokenizers: one folder per tokenizer (<id>/),
            # hub: a hub id's listing; named by what they hold, so shared by every run of a sweep
            scratch={"shards": "shards", "tokenizers": "tokenizers", "hub": "hub"},
            parts={
                "data_tokenizer": ("workflow/scripts/data_tokenizer.py",),
                "tokenize_shard": ("workflow/scripts/tokenize_shard.py",),
            },
        ),
        # hub id, local folder or seeded init -> model folder (safetensors)
        Stage(
            "model",
            "serialize_model",
            "model",
            home="distlm.model",
            commands=("workflow/scripts/serialize_model.py",),
            outputs=_outputs(model=("base", True)),
            reads={
                "tokens": ("prepare_data", "tokens"),
                "tokenizer": ("prepare_data", "tokenizer"),
            },
        ),
        # rank 0 sends the base model to every receiver, verified
        Stage(
            "broadcast",
            "broadcast",
            "broadcast",
            home="distlm.broadcast",
            commands=("distlm.entry.broadcast",),
            outputs=_outputs(report="report.json"),
            document=("report", "BroadcastReport"),
            reads={"model": ("serialize_model", "model")},
        ),
        # DDP training -> final model folder, metrics, TensorBoard, profile
        Stage(
            "train",
            "train",
            "train",
            home="distlm.train",
            commands=("distlm.entry.train",),
            outputs=_outputs(
                final=("final", True),
                metrics="metrics.csv",
                val="val.csv",
                tb=("tb", True),
                profile=("profile", True),
            ),
            reads={
                "tokens": ("prepare_data", "tokens"),
                "tokenizer": ("prepare_data", "tokenizer"),
                "model": ("serialize_model", "model"),
            },
            # checkpoints: the run folders; compile-cache: torch.compile's caches (a resumed or
            # requeued run finds its compiled graphs there instead of compiling again)
            scratch={"checkpoints": "checkpoints", "compile_cache": "compile-cache"},
        ),
        # sliding-window perplexity of the base and the trained model
        Stage(
            "eval",
            "evaluate",
            "eval",
            home="distlm.evaluate",
            commands=("distlm.entry.evaluate",),
            outputs=_outputs(json="{model}.json"),
            document=("json", "EvalReport"),
            reads={"tokens": ("prepare_data", "tokens"), "model": ("{model}", "")},
            instances=EVAL_MODELS,
        ),
        # a model folder -> one shard per pipeline stage, with a sha256 manifest
        Stage(
            "shard",
            "shard",
            "pipeline",
            home="distlm.model",
            commands=("workflow/scripts/shard.py",),
            outputs=_outputs(pipeline=("{model}", True)),
            reads={"model": ("{model}", "")},
            instances=("trained",),
        ),
        # prompts through the pipeline-parallel trained model -> generations, timing
        Stage(
            "inference",
            "inference",
            "inference",
            home="distlm.inference",
            commands=("distlm.entry.infer",),
            outputs=_outputs(generations="generations.jsonl", timing="timing.json"),
            document=("timing", "InferenceTiming"),
            reads={"model": ("shard[trained]", "pipeline")},
        ),
        # every stage's metrics -> figures, tables, one HTML summary
        Stage(
            "report",
            "report",
            "report",
            home="distlm.report",
            commands=("workflow/scripts/report.py", "workflow/scripts/sweep_report.py"),
            outputs=_outputs(summary="summary.html"),  # + every figure and table (report.items)
            reads=REPORT_READS,
        ),
        # the trained model (or the base one: serve.model) -> one shard per serve stage
        # (serve.stages; not in rule all): its own shards, as serve's best stage count (1 on one
        # machine) is not batch inference's
        Stage(
            "serve_shard",
            "serve_shard",
            "serve",
            home="distlm.model",
            commands=("workflow/scripts/shard.py",),
            outputs=_outputs(pipeline=("pipeline", True)),
            reads={"model": ("{model}", "")},  # {model}: serve.model
            in_all=False,
        ),
        # the pipeline behind an OpenAI-compatible API server: writes nothing but its shards; the
        # foreground server of `snakemake serve`
        Stage(
            "serve",
            "serve",
            "serve",
            home="distlm.inference",
            commands=("distlm.entry.serve",),
            outputs={},
            reads={"model": ("serve_shard", "pipeline")},
            in_all=False,
            # endpoint: where a server that follows the training run listens, while it is up
            # (serve.follow_training; the trainer pushes each checkpoint there: distlm.train.pushes)
            scratch={"endpoint": "endpoint.json"},
        ),
    )
}


def _job_consumes(stage: Stage, job: str) -> tuple[str, ...]:
    model = job[len(stage.rule) + 1 : -1] if job.endswith("]") else ""
    return tuple(MODELS[model][0] if c == "{model}" else c for c in stage.consumes)


# Jobs of `rule all` and what each reads, derived from STAGES: the graph the rerun table and the
# sweep follow. A job is a rule, or rule[model] for the evaluate and shard instances.
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    job: (s.name, _job_consumes(s, job)) for s in STAGES.values() if s.in_all for job in s.jobs
}


def rule_stage(rule: str) -> Stage:
    """The stage whose rule is `rule`."""
    return next(s for s in STAGES.values() if s.rule == rule)


def job_stage(job: str) -> Stage:
    """The stage of job `job` (a key of JOBS, or serve_shard/serve)."""
    return rule_stage(job.split("[")[0])


def job_wildcards(job: str) -> dict[str, str]:
    """`evaluate[base]` -> {"model": "base"}; `train` -> {}."""
    return {"model": job[:-1].split("[")[1]} if job.endswith("]") else {}


def job_output(job: str, output: str) -> str:
    """Path of output `output` of job `job` without a sweep (results/...)."""
    return job_stage(job).path(output, **job_wildcards(job))


def select(cfg: Mapping[str, Any], keys: Iterable[str]) -> dict:
    """`cfg` cut down to the dotted `keys` (each with everything under it), nesting kept."""
    out: dict = {}
    for key in keys:
        node: Any = cfg
        parts = key.split(".")
        for p in parts:
            if not isinstance(node, Mapping) or p not in node:
                raise KeyError(f"config key {key!r} does not exist (at {p!r})")
            node = node[p]
        dst = out
        for p in parts[:-1]:
            dst = dst.setdefault(p, {})
        dst[parts[-1]] = copy.deepcopy(node)
    return out


def stage_config(cfg: Mapping[str, Any], stage: str) -> dict:
    """The part of config mapping `cfg` stage `stage` reads, as its rule's params hold it: the
    mapping validated, then `distlm.settings.stage_configs.stage_params` of its typed settings
    (what the workflow calls on the settings it holds)."""
    from distlm.settings.stage_configs import stage_params
    from distlm.settings.validate import validate

    return stage_params(validate(cfg)[1], stage)


# ----------------------------------------------------------------------------- what reruns


# Top-level sections that are no stage's setting: `sweep` turns one config into named runs
# (distlm.dag.sweep; docs/sweeps.md), so it has no row in the rerun table.
NOT_STAGE_KEYS = ("sweep",)


def schema_keys(schema: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every leaf key of the config schema that a stage may read, dotted, in schema order."""
    keys = []
    for name, sub in schema.get("properties", {}).items():
        if not prefix and name in NOT_STAGE_KEYS:
            continue
        key = f"{prefix}{name}"
        if sub.get("type") == "object" and "properties" in sub:
            keys.extend(schema_keys(sub, key + "."))
        else:
            keys.append(key)
    return keys


def reruns(key: str) -> list[str]:
    """The jobs of `rule all` a change of `key` reruns: its readers and all that consume them."""
    hit = {job for job, (stage, _) in JOBS.items() if STAGES[stage].covers(key)}
    changed = True
    while changed:
        changed = False
        for job, (_, consumes) in JOBS.items():
            if job not in hit and hit.intersection(consumes):
                hit.add(job)
                changed = True
    return [job for job in JOBS if job in hit]
