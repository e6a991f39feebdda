"""The workflow from a checkout, a working directory and a prompt file whose paths hold spaces
(every config-derived path in the rules is quoted); then finished training is reused when its final
folder is gone (no step runs, bit-identical weights) and `--forcerun train` trains afresh."""

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


def _snakemake(checkout: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
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
        str(work.parent / "prompts override.yaml"),
        "--profile",
        str(checkout / "profiles" / "local"),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.mark.slow
def test_spaced_paths_finished_work_reused_and_forcerun_trains_afresh(tmp_path):
    base = tmp_path / "dist lm"
    checkout = base / "check out"
    shutil.copytree(ROOT, checkout, ignore=COPY_IGNORE)
    work = base / "work dir"
    work.mkdir()
    prompts = base / "my prompts" / "prompts file.txt"
    prompts.parent.mkdir()
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
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
    steps = read_meta(final)["training"]["steps"]

    # a job killed after its last checkpoint (final/ gone): the rerun writes final/ from it
    shutil.rmtree(final)
    _snakemake(checkout, work, "results/train/final")
    meta = read_meta(final)["training"]
    assert meta["steps_this_run"] == 0 and meta["resumed_from"].endswith(f"step-{steps:08d}")
    assert (final / "model.safetensors").read_bytes() == weights
    assert "is this run's finished work" in (work / "logs" / "train" / "rank0.log").read_text()

    # --forcerun train asks for a fresh run: the checkpoints go, every step runs again
    _snakemake(checkout, work, "results/train/final", "--forcerun", "train")
    meta = read_meta(final)["training"]
    assert meta["steps_this_run"] == steps and meta["resumed_from"] is None
    assert "a fresh run was requested" in (work / "logs" / "train" / "rank0.log").read_text()
    assert (final / "model.safetensors").read_bytes() == weights  # and reproducible
    assert not (work / "results" / "train" / "checkpoints" / "fresh-run-requested.json").exists()
