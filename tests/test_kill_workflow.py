"""The workflow from a checkout, a working directory and a prompt file whose paths hold spaces
(every config-derived path in the rules is quoted); then, through the user's commands: finished
training is reused when its final folder is gone; the forced-rerun table (what each way of forcing
or editing reruns, and whether it trains); a copy of the whole project at another path, and then
a fresh clone of its checkout beside the same results, plan nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distlm.model import read_meta

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    "results",
    "logs",
    ".snakemake",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
)


def _snakemake(checkout: Path, work: Path, *args: str, edit: dict | None = None):
    extra = []
    if edit is not None:
        (work.parent / "edit.yaml").write_text(yaml.safe_dump(edit))
        extra = [str(work.parent / "edit.yaml")]
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(checkout / "Snakefile"),
        "--directory",
        str(work),
        "--configfile",
        str(checkout / "tests" / "configs" / "tiny.yaml"),
        str(checkout / "tests" / "configs" / "tiny-single.yaml"),
        str(work.parent / "prompts override.yaml"),
        *extra,
        "--profile",
        str(checkout / "profiles" / "local"),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def job_counts(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Snakemake's "Job stats" table (rule -> jobs), rule all left out."""
    counts: dict[str, int] = {}
    lines = (proc.stdout + proc.stderr).splitlines()
    if "Job stats:" not in lines:
        return counts
    for line in lines[lines.index("Job stats:") + 3 :]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        if parts[0] != "all":
            counts[parts[0]] = int(parts[1])
    return counts


def _plans_nothing(checkout: Path, work: Path) -> None:
    """`snakemake -n` of the test's targets plans no job."""
    proc = _snakemake(
        checkout,
        work,
        "results/inference/generations.jsonl",
        "results/broadcast/report.json",
        "results/eval/trained.json",
        "-n",
    )
    assert job_counts(proc) == {} and "Nothing to be done" in proc.stdout + proc.stderr, (
        proc.stdout[-3000:]
    )


@pytest.mark.slow
@pytest.mark.with_requeue  # ~3 min: tests/run.sh runs it beside the requeue tests' waits
def test_spaced_paths_finished_work_reused_and_forcerun_trains_afresh(tmp_path):
    base = tmp_path / "dist lm"
    checkout = base / "check out"
    shutil.copytree(ROOT, checkout, ignore=COPY_IGNORE)
    work = base / "work dir"
    work.mkdir()
    prompts = base / "my prompts" / "prompts file.txt"
    prompts.parent.mkdir()
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
    # One process per multi-process stage (tests/configs/tiny-single.yaml): the paths, the reuse
    # and the forced-rerun table do not depend on how many ranks a stage has, and the table
    # starts the train job eight times
    (base / "prompts override.yaml").write_text(
        yaml.safe_dump({"inference": {"prompts": str(prompts)}})
    )
    _snakemake(
        checkout,
        work,
        "results/inference/generations.jsonl",
        "results/broadcast/report.json",
        "results/eval/trained.json",
    )
    gens = [
        json.loads(line)
        for line in (work / "results" / "inference" / "generations.jsonl").read_text().splitlines()
    ]
    assert [g["prompt"] for g in gens] == ["The quick brown fox", "Once upon a time"]
    assert (work / "results" / "broadcast" / "report.json").is_file()
    assert (work / "results" / "eval" / "trained.json").is_file()
    final = work / "results" / "train" / "final"
    weights = (final / "model.safetensors").read_bytes()
    steps = read_meta(final).training["steps"]

    # The whole project copied to another path (checkout, work dir, prompts; mtimes kept):
    # nothing is planned there. No tracked param or shell command holds an absolute path.
    moved = tmp_path / "moved elsewhere"
    shutil.copytree(base, moved, symlinks=True)
    _plans_nothing(moved / "check out", moved / "work dir")

    # The checkout cloned anew beside the same work dir (every file of it, scripts included,
    # newer than the results, as `git clone` or a `git pull` leaves them): nothing is planned.
    # Snakemake's code trigger would rerun every `script:` rule (its script is newer than its
    # outputs) and the whole DAG after them; the profiles leave that trigger out.
    shutil.rmtree(moved / "check out")
    shutil.copytree(checkout, moved / "check out", ignore=COPY_IGNORE, copy_function=shutil.copy)
    script = moved / "check out" / "workflow" / "scripts" / "prepare_data.py"
    assert script.stat().st_mtime > (moved / "work dir/results/data/stats.json").stat().st_mtime
    _plans_nothing(moved / "check out", moved / "work dir")

    # a job killed after its last checkpoint (final/ gone): the rerun writes final/ from it
    shutil.rmtree(final)
    _snakemake(checkout, work, "results/train/final")
    meta = read_meta(final).training
    assert meta["steps_this_run"] == 0 and meta["resumed_from"].endswith(f"step-{steps:08d}")
    assert (final / "model.safetensors").read_bytes() == weights
    assert "is this run's finished work" in (work / "logs" / "train" / "rank0.log").read_text()

    # The forced-rerun table: what each way of asking runs, and whether the train job trains.
    # Checkpoints belong to the run identity: forcing reuses a finished identity (on the CPU the
    # bits are the same); train.resume: never, or an edit of the identity, trains; a revert
    # finds the finished run again.
    target = "results/train/final"
    table = [
        ("--forcerun train", ("--forcerun", "train"), None, False),
        ("--forceall (train's ancestors)", ("--forceall",), None, False),
        ("-f results/train/final", ("-f",), None, False),
        ("train.resume: never", (), {"train": {"resume": "never"}}, True),
        ("edit train.lr", (), {"train": {"lr": 0.003}}, True),
        ("revert the edit", (), None, False),
    ]
    rows = []
    for name, args, edit, trains in table:
        proc = _snakemake(checkout, work, target, *args, edit=edit)
        meta = read_meta(final).training
        ran = sorted(job_counts(proc))
        trained = meta["steps_this_run"] == steps
        rows.append(f"| {name} | {', '.join(ran)} | {'trains' if trained else 'reuses'} |")
        assert "train" in ran, (name, ran)
        assert trained == trains, (name, meta)
        if not trained:
            assert meta["steps_this_run"] == 0 and meta["resumed_from"].endswith(f"{steps:08d}")
            assert (final / "model.safetensors").read_bytes() == weights
        if name == "--forceall (train's ancestors)":
            assert {"prepare_data", "serialize_model"} <= set(ran)
        elif name != "edit train.lr":
            assert set(ran) <= {"train", "resolve_config"}, (name, ran)
    print("\n".join(["| command | jobs | train job |", "| --- | --- | --- |", *rows]))
    runs = [p.name for p in (work / "results" / "train" / "checkpoints").iterdir() if p.is_dir()]
    assert len(runs) == 2  # the edit's run and the original, both kept (keep_runs 3)
    # every attempt appended to the logs: 1 run, 1 reuse, 6 rows
    assert (work / "logs" / "train" / "rank0.log").read_text().count(
        "] INFO distlm.train.trainer: attempt:"
    ) == 8
