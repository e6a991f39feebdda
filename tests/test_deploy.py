"""distlm as a Snakemake module in a project of the user's own (README.md, "Deploy"): deployed
from a local copy of this checkout with `snakedeploy deploy-workflow`, as a user deploys a
release, the tiny config runs every stage through `snakemake --profile profiles/local` in the
project, with the outputs under the project's results/; a second run has nothing to do; the
moved project plans nothing; a config edit reruns exactly the stages that read the key; the
report, a sweep and serve plan from the project.

snakedeploy writes a local source's module as `snakefile: "Snakefile"`, a path relative to the
source, which Snakemake reads relative to the project's Snakefile: the test names the copy's
Snakefile instead, as `snakefile: github(..., path="Snakefile", tag=...)` names a release's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SINGLE, TINY
from test_kill_workflow import COPY_IGNORE, job_counts

pytestmark = [pytest.mark.slow, pytest.mark.with_slurm]
PROFILE = ["--profile", "profiles/local"]
# the tiny config with one rank a stage (tests/configs/tiny-single.yaml), copied into the project
CONFIGS = ["--configfile", "config/config.yaml", "config/tiny.yaml", "config/single.yaml"]


def snakemake(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The user's command in their project (its workflow/Snakefile, its profile, its config)."""
    cmd = [sys.executable, "-m", "snakemake", *args, *PROFILE]
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=1800)
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def said(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deploy")
    source = root / "distlm"
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE)
    project = root / "my project"
    proc = subprocess.run(
        ["snakedeploy", "deploy-workflow", str(source), str(project), "--branch", "main"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    snakefile = project / "workflow" / "Snakefile"
    text = snakefile.read_text()
    assert re.search(r"module distlm:\s+snakefile:\s+\"Snakefile\"", text), text
    assert "use rule * from distlm" in text and "config:\n        config" in text
    snakefile.write_text(text.replace('"Snakefile"', repr(str(source / "Snakefile")), 1))
    assert (project / "profiles" / "local" / "config.yaml").is_file()
    shutil.copy(TINY, project / "config" / "tiny.yaml")
    shutil.copy(SINGLE, project / "config" / "single.yaml")
    snakemake(project, *CONFIGS)
    return project


def test_every_stage_runs_in_the_users_project(deployed):
    res = deployed / "results"
    for out in (
        "data/tokens.h5",
        "broadcast/report.json",
        "train/final/model.safetensors",
        "eval/trained.json",
        "inference/generations.jsonl",
        "report/summary.html",
    ):
        assert (res / out).is_file(), out
    assert not (deployed.parent / "distlm" / "results").exists()  # nothing in the workflow's
    assert "Nothing to be done" in said(snakemake(deployed, "-n", *CONFIGS))


def test_a_moved_project_reruns_nothing_and_an_edit_reruns_its_stages(deployed, tmp_path):
    moved = tmp_path / "moved project"
    shutil.copytree(deployed, moved, symlinks=True)
    assert "Nothing to be done" in said(snakemake(moved, "-n", *CONFIGS))
    (moved / "config" / "edit.yaml").write_text("inference:\n  temperature: 0.5\n")
    plan = snakemake(moved, "-n", *CONFIGS, "config/edit.yaml")
    assert job_counts(plan) == {"resolve_config": 1, "inference": 1, "report": 1}


def test_the_report_a_sweep_and_serve_from_the_project(deployed, tmp_path):
    report = tmp_path / "report.html"
    snakemake(deployed, *CONFIGS, "--report", str(report))
    assert report.stat().st_size > 100_000
    sweep = snakemake(deployed, "-n", *CONFIGS, "config/sweep.yaml")
    assert job_counts(sweep)["train"] == 3  # config/sweep.yaml: 3 learning rates
    serve = snakemake(deployed, "serve", "-n", *CONFIGS)
    assert {"serve_shard", "serve"} <= set(job_counts(serve))
