"""Sweeps: many named runs over one base config, each job run once per distinct setting.

    from distlm.dag.sweep import plan_sweep
    plan = plan_sweep(settings)       # None when the settings have no `sweep` section
    plan.runs["lr-0.001"].variants    # {"prepare_data": "3fa2c1d09b7e", "train": ..., ...}

A run is a partial config merged over the base config (`sweep.runs`), or one point of the grid
shorthand (`sweep.grid`: dotted key -> list of values, crossed). The sweep is the validated
settings' `sweep` section (distlm.settings.sweep.SweepSettings); every run's override goes
through `distlm.settings.validate.with_override`, the base config's validation, and an error
names the run and the key, before any job starts.

Sharing is derived from the stage declarations (`distlm.dag.stages`), never per key: a job's *variant*
is the sha256 of its job name, the config keys its stage reads (`STAGES[stage].keys`, for that
run) and the variants of the jobs it consumes (`JOBS`). Runs whose variant of a job agree share
that job. A variant depends on nothing but the run's own config, so:

- adding a run plans only the jobs whose variants are new, plus the report;
- removing a run plans only the report (no shared job's path names a run);
- editing a run's override changes the variants of the jobs that read the key and of those that
  consume them, and nothing else; reverting the edit finds the old variant's outputs again.

Each job variant writes exactly what the job writes without a sweep, under
`results/variants/<variant>/` (logs under `logs/variants/<variant>/`): `results/train/final` of
variant 3fa2c1d09b7e is `results/variants/3fa2c1d09b7e/train/final`, its checkpoints and lease
`results/variants/3fa2c1d09b7e/train/checkpoints/`, so two runs' trainers run at once. The report
writes the per-run view, `results/runs/<run>/run.json` (its override, varied keys and the variant
folder of each job) and `results/runs/<run>/report/` (the run's own report pages).

This module imports nothing heavy: the workflow reads it while it builds the DAG.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from distlm.core.documents import Document
from distlm.core.io import digest
from distlm.dag.config import ConfigError
from distlm.dag.stages import JOBS, RESULTS, job_output
from distlm.settings.root import Settings
from distlm.settings.stage_configs import stage_params
from distlm.settings.sweep import DOTTED_PATTERN, NAME_MAX, NAME_PATTERN, SweepSettings
from distlm.settings.validate import deep_merge, validate, with_override

VARIANTS = f"{RESULTS}/variants"  # one folder per job variant: results/variants/<variant>/...
RUNS = f"{RESULTS}/runs"  # the per-run view the report writes: results/runs/<run>/...
LOGS = "logs"
VARIANT_CHARS = 12  # hex digits of a variant's sha256 (48 bits: no collision in any real sweep)
VARIANT_PATTERN = f"[0-9a-f]{{{VARIANT_CHARS}}}"
_NAME = re.compile(NAME_PATTERN)
_DOTTED = re.compile(DOTTED_PATTERN)
# Sections a run may not override: one report for the whole sweep, and serve is no job of a sweep.
WHOLE_SWEEP = ("sweep", "report", "serve")
SWEEP_JOBS = tuple(job for job in JOBS if job != "report")  # the jobs each run has a variant of


class SweepError(ConfigError):
    """A sweep is malformed: the message names the run and the key."""


def check_name(name: object, where: str) -> str:
    """`name` if it is a safe run name (a folder name and a wildcard value), else SweepError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > NAME_MAX:
        raise SweepError(
            f"{where}: run name {name!r} is not allowed: a run name is a folder name, "
            f"{NAME_PATTERN} (a letter or digit, then letters, digits, '_', '.', '-'; no '/'), "
            f"at most {NAME_MAX} characters"
        )
    return name


def nested(override: Mapping[str, Any], where: str) -> dict:
    """A run's override with dotted keys (`train.lr`) expanded into sections."""
    out: dict = {}
    for key, value in override.items():
        if not isinstance(key, str) or not _DOTTED.fullmatch(key):
            raise SweepError(f"{where}: {key!r} is not a config key")
        if isinstance(value, Mapping):
            value = nested(value, f"{where}.{key}")
        parts = key.split(".")
        out = deep_merge(out, _tree(parts, value))
    return out


def _tree(parts: list[str], value: Any) -> dict:
    return {parts[0]: value} if len(parts) == 1 else {parts[0]: _tree(parts[1:], value)}


def _token(value: Any) -> str:
    """A grid value as a piece of a run name: 0.001, 2, true, cpu; a list joins with '+'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "+".join(_token(v) for v in value)
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(value)).strip("_.") or "_"


def grid_name(keys: list[str], point: tuple) -> str:
    """The run name of one grid point: `<key>-<value>` joined with '_', a key by its shortest
    dotted suffix that tells the grid's keys apart (`lr-0.001_stages-2`)."""
    parts = []
    for key, value in zip(keys, point):
        split = key.split(".")
        for n in range(1, len(split) + 1):
            short = ".".join(split[-n:])
            if sum(1 for k in keys if k == short or k.endswith("." + short)) == 1:
                break
        parts.append(f"{short}-{_token(value)}")
    return "_".join(parts)


def expand_runs(sweep: SweepSettings) -> dict[str, dict]:
    """The `sweep` section -> run name -> nested override, grid points after named runs."""
    runs: dict[str, dict] = {}
    for name, override in sweep.runs.items():
        check_name(name, f"sweep.runs.{name}")
        runs[name] = nested(override, f"sweep.runs.{name}")
    if sweep.grid:
        keys = list(sweep.grid)
        for key in keys:
            if not _DOTTED.fullmatch(key):
                raise SweepError(f"sweep.grid: {key!r} is not a dotted config key")
        for point in itertools.product(*(sweep.grid[k] for k in keys)):
            name = grid_name(keys, point)
            where = f"sweep.grid ({', '.join(f'{k}={v!r}' for k, v in zip(keys, point))})"
            check_name(name, where)
            if name in runs:
                raise SweepError(
                    f"{where}: run name {name!r} is taken (by a named run or another grid point "
                    "whose values read the same); name the runs under sweep.runs instead"
                )
            runs[name] = nested(dict(zip(keys, point)), where)
    if not runs:
        raise SweepError("sweep: no runs (give sweep.runs or sweep.grid, or remove sweep)")
    return runs


def leaves(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested config, by dotted key (a list is one leaf)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, Mapping) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def variant_path(path: str, variant: str | None) -> str:
    """Where job variant `variant` writes `path` (a path under results/ or logs/ without a
    sweep): every output, log and benchmark path of a job goes through here. Variant None is the
    one variant of a config without a sweep, whose paths are `path` itself."""
    if variant is None:
        return path
    for root in (RESULTS, LOGS):
        if path.startswith(root + "/"):
            return f"{root}/variants/{variant}/{path[len(root) + 1 :]}"
    raise ValueError(f"{path!r} is not under {RESULTS}/ or {LOGS}/")


def output_path(job: str, output: str, variant: str | None) -> str:
    """Path of output `output` of job `job` (distlm.dag.stages.JOBS) in variant `variant`."""
    return variant_path(job_output(job, output), variant)


@dataclass(frozen=True)
class Run:
    """One run of a sweep: its override, its typed settings, its variant of each job."""

    name: str
    override: dict
    settings: Settings  # the base config's with the override merged over it, validated
    variants: dict[str, str]  # job (distlm.dag.stages.JOBS) -> variant

    @property
    def config(self) -> dict:
        """The run's whole config as a mapping (defaults filled in, the config's key order)."""
        return self.settings.model_dump(exclude={"sweep"})


class Wildcards(Protocol):
    variant: str


@dataclass(frozen=True)
class Single:
    """A config without a sweep: one run, whose one job variant writes today's paths (variant
    None: no {variant} wildcard, nothing moves). The workflow asks it what it asks a Plan."""

    settings: Settings
    variant: ClassVar[None] = None  # the {variant} placeholder of a job's paths: none
    report_rules: ClassVar[str] = "report.smk"

    def settings_of(self, wildcards: object) -> Settings:
        return self.settings

    @property
    def every_settings(self) -> list[Settings]:
        """The typed settings of every run: this one."""
        return [self.settings]

    def upstream(self, wildcards: object, job: str) -> None:
        return None

    def targets(self, job: str, output: str) -> list[str]:
        return [output_path(job, output, None)]


@dataclass(frozen=True)
class Plan:
    """A sweep expanded: its runs, and for each job variant the runs that share it."""

    runs: dict[str, Run]
    shared: dict[str, dict[str, list[str]]]  # job -> variant -> names of the runs sharing it
    settings: Settings  # the base config's: the report's and serve's (whole-sweep sections)
    variant: ClassVar[str] = "{variant}"  # every job's paths move under its variant's folder
    report_rules: ClassVar[str] = "sweep.smk"  # the runs side by side, each run's own report

    def settings_of(self, wildcards: Wildcards) -> Settings:
        """The typed settings of the job variant's run."""
        return self.by_variant[wildcards.variant][1].settings

    @property
    def every_settings(self) -> list[Settings]:
        """The typed settings of every run."""
        return [r.settings for r in self.runs.values()]

    @cached_property
    def by_variant(self) -> dict[str, tuple[str, Run]]:
        """variant -> (its job, the first run that has it)."""
        return {
            v: (job, self.runs[names[0]])
            for job, vs in self.shared.items()
            for v, names in vs.items()
        }

    def upstream(self, wildcards: Wildcards, job: str) -> str:
        """The variant of `job` that the job variant of `wildcards` consumes."""
        return self.by_variant[wildcards.variant][1].variants[job]

    def varied(self) -> list[str]:
        """Dotted keys whose values differ between runs, in config order."""
        flat = [leaves(r.config) for r in self.runs.values()]
        keys = list(dict.fromkeys(k for f in flat for k in f))
        return [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]

    def targets(self, job: str, output: str) -> list[str]:
        """Paths of `output` of every variant of `job` (what `rule all` and the report ask for)."""
        return [output_path(job, output, v) for v in self.shared[job]]


def variant_folder(variant: str) -> str:
    """results/variants/<variant>: the folder of one job variant's outputs."""
    return variant_path(RESULTS + "/", variant).rstrip("/")


def job_variants(settings: Settings) -> dict[str, str]:
    """Each job's variant for a run's typed settings: its stage's keys + consumed variants."""
    out: dict[str, str] = {}
    for job in SWEEP_JOBS:
        stage, consumes = JOBS[job]
        key = {
            "job": job,
            "config": stage_params(settings, stage),
            "consumes": {c: out[c] for c in consumes},
        }
        out[job] = digest(key)[:VARIANT_CHARS]
    return out


def plan_runs(settings: Settings) -> Single | Plan:
    """The runs of validated `settings`: a Plan with a `sweep` section, else the one run;
    SweepError or ConfigError (naming the run and the key) when a run is malformed."""
    plan = plan_sweep(settings)
    return Single(settings) if plan is None else plan


def plan_sweep(config: Settings | Mapping[str, Any], *, source: str = "config") -> Plan | None:
    """The sweep of `config` (typed settings, or a config mapping validated here), or None
    without a `sweep` section; SweepError or ConfigError (naming the run and the key) when a run
    is malformed."""
    settings = config if isinstance(config, Settings) else validate(config, source=source)[1]
    if settings.sweep is None:
        return None
    runs: dict[str, Run] = {}
    for name, override in expand_runs(settings.sweep).items():
        bad = [k for k in WHOLE_SWEEP if k in override]
        if bad:
            raise SweepError(
                f"sweep run {name!r}: {bad[0]}: not a per-run setting (set it in the base config; "
                "a sweep has one report, and serve is not a job of a sweep)"
            )
        typed = with_override(settings, override, source=f"sweep run {name!r}")
        runs[name] = Run(name, override, typed, job_variants(typed))
    shared: dict[str, dict[str, list[str]]] = {job: {} for job in SWEEP_JOBS}
    for run in runs.values():
        for job, v in run.variants.items():
            shared[job].setdefault(v, []).append(run.name)
    return Plan(runs, shared, settings)


def job_counts(plan: Plan) -> dict[str, tuple[int, int]]:
    """job -> (jobs the sweep runs, jobs the same runs as separate working folders run)."""
    n = len(plan.runs)
    counts = {job: (len(vs), n) for job, vs in plan.shared.items()}
    counts["report"] = (1, n)
    return counts


def run_dir(run: str) -> str:
    """results/runs/<run>: the per-run view the report writes."""
    return f"{RUNS}/{run}"


class RunDescription(BaseModel):
    """One run of a sweep as the report sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    override: dict[str, Any]  # the partial config merged over the base config
    varied: dict[str, Any]  # the sweep's varied keys -> this run's value
    variants: dict[str, str]  # job -> its variant


class SweepDescription(BaseModel):
    """What the report needs of a sweep (the report rule's param, as `model_dump()`; the script
    validates it back): the runs, the varied keys, the runs each job variant serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    varied: list[str]
    runs: dict[str, RunDescription]
    shared: dict[str, dict[str, list[str]]]  # job -> variant -> the runs it serves

    def labels(self, run: str, **labels: str) -> dict[str, str]:
        """report() labels of a run's output: the run and its values of the varied keys, so
        `snakemake --report` lets one switch between runs."""
        varied = self.runs[run].varied
        return {"run": run, **{k: str(v) for k, v in varied.items()}, **labels}


def describe(plan: Plan) -> SweepDescription:
    """The sweep's description for the report."""
    varied = plan.varied()
    return SweepDescription(
        varied=varied,
        runs={
            name: RunDescription(
                override=run.override,
                varied={k: leaves(run.config).get(k) for k in varied},
                variants=run.variants,
            )
            for name, run in plan.runs.items()
        },
        shared=plan.shared,
    )


class SweepRun(Document):
    """results/runs/<run>/run.json: one run of a sweep, written by the report."""

    KIND: ClassVar[str] = "distlm-sweep-run"
    VERSION: ClassVar[int] = 1

    name: str
    override: dict[str, Any]  # the partial config merged over the base config
    varied: dict[str, Any]  # the sweep's varied keys -> this run's value
    jobs: dict[str, str]  # job -> the variant folder holding its outputs (results/variants/<v>)
