"""One `snakemake --profile <the SLURM profile>` command trains to the end across allocations, on
the local cluster (tests/harness/slurm_cluster.py):

- a train job whose time limit (2 minutes) is a fraction of the training: the launcher's SIGUSR1
  35 s before it stops the ranks at a checkpoint, the launcher requeues the job (`scontrol
  requeue`), Snakemake keeps waiting on the same job id, and the next allocation resumes there.
  The job restarts at least once, no step trains twice, and the final weights are byte-identical
  to an uninterrupted run of the same config and topology;
- the bound: with `--max-requeues=1` a training that needs more allocations stops after one
  requeue, and Snakemake reports the launcher's message;
- a training that fails on its own (an injected NaN loss) is never requeued;
- preemption with `--slurm-requeue`: a job of the urgent partition takes the nodes, SLURM requeues
  the train job (SIGTERM: checkpoint at the step boundary), and the same command finishes.

Between allocations SLURM holds a requeued job (Reason=BeginTime, then its next scheduling pass):
about three minutes with SLURM's defaults, SLURM's own delay that a user's job just waits out. The
test cluster's slurm.conf shortens it to ~17 s (cred_expire, sched_interval in
tests/harness/slurm_cluster.py) so each requeue here is cheap. The data and base model are built
once and copied; one uninterrupted reference run serves every weight comparison. The first test's
two commands and the reference train at the same time (the test waits out the time limits once):
each train job takes 1 of a node's 4 CPUs.
"""

from __future__ import annotations

import csv
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import snakemake_cmd
from harness.faults import fault_env
from slurm_training import (
    TARGET,
    cluster_env,
    long_training,
    prepared,
    profile_with,
    slurm_env,
)
from test_slurm import job_fields, sh, submissions

from distlm.model import read_meta
from distlm.train import checkpoint as ck
from distlm.train import identity as ident

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_requeue]
# One allocation (2 minutes, warned 35 s before its end) trains for its first 85 s less the start
# (the job's Snakemake, torchrun and the ranks' imports: ~10 s on a quiet machine, 30-35 s while
# tests/run.sh's other sessions load the 2 cores; with a 1-minute limit that left 0-7 s of training
# an allocation there, and 8 requeues did not reach 300 steps). Training is paced at 10 steps/s at
# most (slurm_training.STEP_S), so 1000 steps take 100 s or more: two allocations or more whatever
# the machine (two in CI runs under load: 678 + 322 and 559 + 441 steps; --max-requeues=8 below
# leaves room for a slower one), and 2 x 1000 more than two (the bound's case, by construction).
STEPS = 1000
LONG = long_training(STEPS)
# The preemption case under fsdp: its own uninterrupted reference, so half the steps (a paced
# 50 s: the preemption comes at step 100 or soon after, ~10 s in).
FSDP_STEPS = 500
FSDP_LONG = {"train": {**long_training(FSDP_STEPS)["train"], "parallel": "fsdp"}}
LIMITED = {"runtime": 2}
MAX_REQUEUES = 8


def _launcher(*opts: str) -> str:
    return "'distlm-launch srun-torchrun --signal-before=35 " + " ".join(opts) + "'"


def _prepared(built: Path, tmp_path: Path, name: str, overlay_cfg: dict = LONG):
    """A copy of the session's built work dir (tests/conftest.py: slurm_built), and the config
    files of its training."""
    return prepared(built, tmp_path / name, overlay_cfg)


class Started:
    """A command of the user's, started now, its output to a file: `finished` waits for it."""

    def __init__(self, cluster, wd: Path, configs: tuple, profile: Path, env=None) -> None:
        self.wd, self.out = wd, wd.parent / f"{wd.name}.out"
        with self.out.open("w") as f:
            self.proc = subprocess.Popen(
                snakemake_cmd(wd, TARGET, configfiles=configs, profile=profile),
                env=env or slurm_env(cluster),
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def finished(self, timeout: float) -> tuple[int, str]:
        """(exit code, output); a command still running after `timeout` s fails the test."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"still running after {timeout} s:\n{self.out.read_text()[-5000:]}"
            )
        return self.proc.returncode, self.out.read_text()

    def stop(self) -> None:
        """Snakemake cancels its SLURM jobs on a TERM; a KILL if it has not ended in 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Reference(Started):
    """The uninterrupted run: the same config and topology, one allocation long enough for all of
    it (the profile's runtime), not paced (a step's pace is a sleep: the same bits, ~100 s
    sooner). It trains while the tests that compare with it do; `weights` waits for it."""

    def weights(self) -> bytes:
        rc, out = self.finished(timeout=900)
        assert rc == 0, out[-3000:]
        assert _attempts(self.wd) == [0]
        return _weights(self.wd)


@pytest.fixture(scope="module")
def reference(cluster, profile, slurm_built, tmp_path_factory):
    ref, configs = _prepared(slurm_built, tmp_path_factory.mktemp("requeue-ref"), "reference")
    started = Reference(cluster, ref, configs, profile, env=cluster_env(cluster))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def fsdp_reference(cluster, profile, slurm_built, tmp_path_factory):
    """The uninterrupted run under train.parallel fsdp (only the fsdp case asks for it)."""
    ref, configs = _prepared(
        slurm_built, tmp_path_factory.mktemp("requeue-ref-fsdp"), "reference", FSDP_LONG
    )
    started = Reference(cluster, ref, configs, profile, env=cluster_env(cluster))
    yield started
    started.stop()


def _weights(wd: Path) -> bytes:
    return (wd / "results" / "train" / "final" / "model.safetensors").read_bytes()


def _train_job(out: str) -> str:
    jobs = submissions(out)
    assert list(jobs) == ["train"], jobs  # the copied data and base model are not rebuilt
    (job_id,) = jobs["train"]  # one submission: requeues keep the job id
    return job_id


def _attempts(wd: Path) -> list[int]:
    """The SLURM restart count of each attempt, from the trainer's `attempt:` lines."""
    log = (wd / "logs" / "train" / "rank0.log").read_text()
    return [int(n) for n in re.findall(r"attempt: .*?, SLURM restart (\d+),", log)]


def _metric_steps(wd: Path) -> list[int]:
    with (wd / "results" / "train" / "metrics.csv").open() as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def _stops(wd: Path, how: str, steps: int = STEPS) -> list[int]:
    log = (wd / "logs" / "train" / "rank0.log").read_text()
    return [int(n) for n in re.findall(rf"stopping at step (\d+) of {steps} \({how}", log)]


@pytest.mark.timeout(2400)
def test_one_command_trains_past_the_time_limit_and_the_bound_holds(
    cluster, profile, slurm_built, reference, tmp_path
):
    # 1. runtime 2 minutes, warned 35 s before, up to 8 requeues: ONE command trains to the end;
    # 2. the bound: one requeue allowed, a training that needs more (twice as long): it stops
    # after one, and Snakemake reports the launcher's message. The two commands run together.
    wd, configs = _prepared(slurm_built, tmp_path, "requeued")
    requeuing = profile_with(
        profile,
        tmp_path / "requeuing",
        **LIMITED,
        torchrun=_launcher(f"--max-requeues={MAX_REQUEUES}"),
    )
    longer = 2 * STEPS
    wd2, configs2 = _prepared(
        slurm_built,
        tmp_path,
        "bounded",
        {"train": {**LONG["train"], "max_steps": longer, "eval_every": longer}},
    )
    bounded = profile_with(
        profile, tmp_path / "bounded-profile", **LIMITED, torchrun=_launcher("--max-requeues=1")
    )
    runs = (Started(cluster, wd, configs, requeuing), Started(cluster, wd2, configs2, bounded))
    try:
        rc, out = runs[0].finished(timeout=1500)
        rc2, out2 = runs[1].finished(timeout=900)
    finally:
        for run in runs:
            run.stop()

    assert rc == 0, out[-5000:]
    job = _train_job(out)
    restarts = int(job_fields(cluster, job)["Restarts"])
    assert 1 <= restarts <= MAX_REQUEUES
    assert _attempts(wd) == list(range(restarts + 1))  # one attempt per allocation, logged
    stops = _stops(wd, "SIGUSR1")
    assert len(stops) == restarts and stops == sorted(stops) and 0 < stops[0]
    # Snakemake empties the rule's log at each allocation's start: the last one's launcher lines;
    # the job's SLURM log (--open-mode=append) keeps every allocation's end
    train_log = (wd / "logs" / "train" / "train.log").read_text()
    assert f"job {job}, allocation {restarts + 1} (SLURM restart count {restarts}," in train_log
    slurm_log = (wd / ".snakemake" / "slurm_logs" / "rule_train" / f"{job}.log").read_text()
    assert slurm_log.count("DUE TO JOB REQUEUE") == restarts
    # no step trained twice: each step once in metrics.csv, in order; each resume from the stop
    assert _metric_steps(wd) == list(range(1, STEPS + 1))
    rank0 = (wd / "logs" / "train" / "rank0.log").read_text()
    for step in stops:
        assert f"(step {step} of {STEPS}" in rank0.split(f"stopping at step {step} of")[1]
    assert read_meta(wd / "results" / "train" / "final").training["steps"] == STEPS
    assert _weights(wd) == reference.weights()

    # 2. the bound
    assert rc2 != 0
    job2 = _train_job(out2)
    assert job_fields(cluster, job2)["Restarts"] == "1"
    assert _attempts(wd2) == [0, 1]
    (last,) = _stops(wd2, "SIGUSR1", longer)[1:]
    log2 = (wd2 / "logs" / "train" / "train.log").read_text()
    assert (
        f"training stopped at step {last} of {longer} for the time limit after 1 requeues of job "
        f"{job2}: --max-requeues=1 reached, not requeued again"
    ) in log2
    assert "Error in rule train" in out2
    # Snakemake removed the failed job's outputs (metrics.csv); the checkpoint stays for a rerun
    ((run, _),) = ident.list_runs(wd2 / "results" / "train" / "checkpoints")
    assert last in [c.step for c in ck.list_checkpoints(run)]


@pytest.mark.timeout(900)
def test_a_training_that_fails_on_its_own_is_never_requeued(
    cluster, profile, slurm_built, tmp_path
):
    wd, configs = _prepared(slurm_built, tmp_path, "nan", LONG)
    # requeues armed, with a time limit far from the NaN: a 3-minute allocation warns at 145 s
    # (with a 1-minute limit the warning came at 25 s, and on a loaded CI machine the ranks
    # took that long to start: a time-limit stop at step 1, requeued, before any NaN)
    requeuing = profile_with(
        profile, tmp_path / "requeuing", runtime=3, torchrun=_launcher("--max-requeues=3")
    )
    # the test harness's fault (never a config key): every rank's loss is NaN at step 5
    nan = fault_env(tmp_path / "faults.json", slurm_env(cluster), nan_at_step=5)
    rc, out = Started(cluster, wd, configs, requeuing, env=nan).finished(timeout=900)
    assert rc != 0
    job = _train_job(out)
    fields = job_fields(cluster, job)
    assert fields["Restarts"] == "0" and fields["JobState"] == "FAILED", fields
    assert _attempts(wd) == [0]
    log = (wd / "logs" / "train" / "train.log").read_text()
    assert "without a stop notice: an error, not a time-limit stop; not requeued" in log
    assert "requeueing job" not in log
    assert "Error in rule train" in out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_preempted_train_job_is_requeued_by_slurm_and_resumes(
    cluster, profile, slurm_built, request, tmp_path, parallel
):
    """Under train.parallel `parallel`: fsdp's ranks each write their shards of the checkpoint
    at the step SIGTERM reached, and the requeued job's ranks load theirs; the final weights are
    bit for bit the uninterrupted run's under the same mode."""
    from harness import slurm_cluster as sc

    # the urgent job below would preempt the reference's job too: it has ended first
    want = request.getfixturevalue(
        "fsdp_reference" if parallel == "fsdp" else "reference"
    ).weights()
    steps, overlay = (FSDP_STEPS, FSDP_LONG) if parallel == "fsdp" else (STEPS, LONG)
    wd, configs = _prepared(slurm_built, tmp_path, "preempted", overlay)
    proc = subprocess.Popen(
        [*snakemake_cmd(wd, TARGET, configfiles=configs, profile=profile), "--slurm-requeue"],
        env=slurm_env(cluster),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = wd / "logs" / "train" / "rank0.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and len(re.findall(r" step \d+/\d+ loss", log.read_text())) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.5)
    # a job of the urgent partition needs both nodes whole: SLURM preempts (requeues) the train job
    urgent = sh(
        cluster,
        [
            "sbatch",
            "--parsable",
            f"--partition={sc.URGENT_PARTITION}",
            "--nodes=2",
            "--exclusive",
            "--time=1",
            "--output=/dev/null",
            "--wrap=sleep 5",
        ],
    ).stdout.strip()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    job = _train_job(out)
    assert job_fields(cluster, job)["Restarts"] == "1"
    assert job_fields(cluster, urgent)["JobState"] == "COMPLETED"
    assert _attempts(wd) == [0, 1]
    (stop,) = _stops(wd, "SIGTERM", steps)
    assert 0 < stop < steps
    rank0 = log.read_text()
    assert f"(step {stop} of {steps}" in rank0.split(f"stopping at step {stop} of")[1]
    assert _metric_steps(wd) == list(range(1, steps + 1))
    assert _weights(wd) == want
    # SLURM requeued it, not the launcher (no time-limit warning was sent)
    assert "requeueing job" not in (wd / "logs" / "train" / "train.log").read_text()
