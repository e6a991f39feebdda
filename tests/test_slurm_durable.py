"""Finished work survives SLURM's everyday events, through `snakemake --profile <the SLURM
profile>` on the local cluster (tests/harness/slurm_cluster.py):

- a train job whose time limit comes before the end: 30 s before it the launcher's SIGUSR1 makes
  the ranks checkpoint at the step boundary and stop; the rerun resumes from that step;
- an `scancel` of the rerun: SIGTERM, the same;
- Snakemake killed while its train job runs, `--unlock`, the same command: the second train job
  stops at once naming the first (no second trainer), no checkpoint is deleted, and once the first
  has ended the same command writes final/ from its finished checkpoint without a training step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import snakemake_cmd
from harness.faults import paced_env
from slurm_training import (
    STEP_S,
    TARGET,
    cluster_env,
    long_training,
    prepared,
    profile_with,
    slurm_env,
)
from test_slurm import sh, submissions

from distlm.model import read_meta
from distlm.train import checkpoint as ck
from distlm.train import identity as ident

pytestmark = pytest.mark.slurm
# Paced at 10 steps/s at most (slurm_training.STEP_S): 60 s of training or more, so the first
# attempt is still training when its limit's warning comes (~20 s in); below ckpt_every (1000):
# every checkpoint before the end is a stop's.
STEPS = 600
LONG = long_training(STEPS)
# The killed Snakemake's job is held in training (DISTLM_TEST_HOLD) until the second command
# has ended: it needs no more steps than a logged one and its end.
HELD_STEPS = 100


def _prepared(
    built: Path, tmp_path: Path, overlay_cfg: dict = LONG
) -> tuple[Path, tuple[Path, ...]]:
    """A work dir whose data and base model exist (a copy of the session's), and its configs."""
    return prepared(built, tmp_path / "work", overlay_cfg)


def _steps(run_dir: Path) -> list[int]:
    return [c.step for c in ck.list_checkpoints(run_dir)]


def _run_dir(wd: Path) -> Path:
    (run,) = [r for r, _ in ident.list_runs(wd / "results" / "train" / "checkpoints")]
    return run


def _stopped_at(wd: Path, how: str) -> int:
    log = (wd / "logs" / "train" / "rank0.log").read_text()
    found = re.findall(rf"stopping at step (\d+) of {STEPS} \({how}", log)
    assert found, log[-3000:]
    return int(found[-1])


def _wait_for(pred, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _training(wd: Path, since: int = 0) -> bool:
    p = wd / "logs" / "train" / "rank0.log"
    return p.exists() and len(re.findall(r" step \d+/\d+ loss", p.read_text())) > since


@pytest.mark.timeout(900)
def test_time_limit_and_scancel_checkpoint_and_the_rerun_resumes(
    cluster, profile, slurm_built, tmp_path
):
    wd, configs = _prepared(slurm_built, tmp_path)
    env = slurm_env(cluster)
    # 1. runtime 1 minute, the launcher's warning 30 s before the limit: SIGUSR1, checkpoint, stop
    # (no --max-requeues: requeueing off, so the job ends; tests/test_slurm_requeue.py has it on)
    limited_profile = profile_with(
        profile,
        tmp_path / "limited",
        runtime=1,
        torchrun="'distlm-launch srun-torchrun --signal-before=30'",
    )
    limited = subprocess.run(
        snakemake_cmd(wd, TARGET, configfiles=configs, profile=limited_profile),
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert limited.returncode != 0
    first = _stopped_at(wd, "SIGUSR1")
    assert 0 < first < STEPS and first % LONG["train"]["ckpt_every"] != 0
    assert first in _steps(_run_dir(wd))
    assert "reaches its time limit" in (wd / "logs" / "train" / "train.log").read_text()

    # 2. the rerun resumes from that step; an scancel of it (SIGTERM) checkpoints likewise
    proc = subprocess.Popen(
        snakemake_cmd(wd, TARGET, configfiles=configs, profile=profile),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = wd / "logs" / "train" / "rank0.log"
    seen = len(re.findall(r" step \d+/\d+ loss", log.read_text()))
    _wait_for(lambda: _training(wd, seen + 2), "the rerun to train")
    run = _run_dir(wd).relative_to(wd)
    assert f"resuming from {run / f'step-{first:08d}'} (step {first} of" in log.read_text()
    jobs = [
        j
        for j in sh(cluster, ["squeue", "-h", "-o", "%i %j %k"]).stdout.splitlines()
        if "rule_train" in j
    ]
    assert len(jobs) == 1, jobs
    sh(cluster, ["scancel", jobs[0].split()[0]])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    second = _stopped_at(wd, "SIGTERM")
    assert second > first and second in _steps(_run_dir(wd)), out[-3000:]


@pytest.mark.timeout(900)
def test_a_killed_snakemake_never_gets_a_second_trainer(cluster, profile, slurm_built, tmp_path):
    wd, configs = _prepared(slurm_built, tmp_path, long_training(HELD_STEPS))
    # the first job's steps wait while `hold` exists: it is still training when the second
    # command's job starts, however long that start takes on a loaded machine
    hold = tmp_path / "hold"
    hold.touch()
    cmd = snakemake_cmd(wd, TARGET, configfiles=configs, profile=profile)
    first = subprocess.Popen(
        cmd,
        env=paced_env(cluster_env(cluster), STEP_S, hold=hold),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    env = slurm_env(cluster)
    _wait_for(lambda: hold.with_name("hold.reached").exists(), "the first job to train", 300)
    os.killpg(first.pid, signal.SIGKILL)  # a dropped ssh session: the SLURM job goes on
    out1, _ = first.communicate(timeout=30)
    (job_id,) = submissions(out1)["train"]
    before = _steps(_run_dir(wd))

    subprocess.run([*cmd, "--unlock"], env=env, check=True, capture_output=True, timeout=120)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode != 0
    logs = (wd / "logs" / "train" / "train.log").read_text()
    assert f"SLURM job {job_id}" in logs and "another process is already running training" in logs
    after = _steps(_run_dir(wd))
    assert not set(before) - set(after) or max(after) > max(before)  # nothing lost
    hold.unlink()  # the first job trains on to its end

    _wait_for(
        lambda: not sh(cluster, ["squeue", "-h", "-j", job_id]).stdout.strip(),
        f"job {job_id} to end",
        timeout=600,
    )
    assert HELD_STEPS in _steps(_run_dir(wd))  # it finished its run
    subprocess.run([*cmd, "--unlock"], env=env, check=True, capture_output=True, timeout=120)
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert read_meta(wd / "results" / "train" / "final").training["steps"] == HELD_STEPS
    # no step trained twice: only the first job trained (the final command, if the first job's
    # outputs were incomplete, wrote final/ from its finished checkpoint)
    log = (wd / "logs" / "train" / "rank0.log").read_text()
    assert (
        log.count(f" step 50/{HELD_STEPS} loss") == 1
        and log.count(f" step {HELD_STEPS}/{HELD_STEPS} loss") == 1
    )
