"""The requeue decision: whether a training that stopped puts its SLURM job back in the queue.

The decision rests on an explicit signal from the trainer, never on an exit code. The launcher
names a file in DISTLM_STOP_NOTICE (`notice_path`: in the job's working directory, shared by
every node); rank 0 of a training that stopped on a signal at a step boundary writes a StopNotice
document there once that step's checkpoint is durable (distlm.train.stopping). Only a notice that
names SIGUSR1, after the launcher itself sent it (--signal-before), makes the launcher requeue the
job (`scontrol requeue JOBID`, as submitit does), at most --max-requeues times per job. No notice
(an error, a NaN loss, a bad config, a killed rank) or another signal (scancel's or preemption's
SIGTERM: SLURM's own `--requeue` handles the latter) never does.

A requeued job keeps its id and name, so the Snakemake SLURM plugin keeps waiting on it (it reads
REQUEUED and PENDING as still active), and its next allocation resumes from that checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

from distlm import DistlmError
from distlm.core.documents import read_document
from distlm.launch.slurm import Allocation, say, scontrol
from distlm.train.documents import StopNotice

# After `scontrol requeue`, SLURM ends this allocation (SIGTERM to the batch script, then SIGKILL
# after KillWait); the launcher waits for that rather than exiting first.
REQUEUE_WAIT_S = 300


def notice_path(alloc: Allocation, cwd: Path | None = None) -> Path:
    """Where the trainer's StopNotice goes: the job's working directory, which every node shares
    (the SLURM plugin's logs and the results live there too), one file per job and allocation
    (no folder of its own: nothing that one job removes while another writes there)."""
    base = Path.cwd() if cwd is None else cwd
    return base / f".distlm-launch-job-{alloc.job_id}-allocation-{alloc.restarts + 1}.stop.json"


def read_notice(path: Path) -> StopNotice | None:
    """The notice at `path`, if the trainer wrote one; the file is removed either way."""
    if not path.exists():
        return None
    try:
        return read_document(path, StopNotice)
    finally:
        path.unlink(missing_ok=True)


def requeue_decision(
    alloc: Allocation, max_requeues: int, *, rc: int, warned: bool, notice: StopNotice | None
) -> tuple[bool, str]:
    """(requeue the job?, why): only a training that the launcher's own SIGUSR1 stopped at a
    written checkpoint (its StopNotice names SIGUSR1) is requeued, at most max_requeues times."""
    if rc == 0:
        return False, "training finished"
    if notice is None:
        return False, (
            f"training failed (exit code {rc}) without a stop notice: an error, not a "
            "time-limit stop; not requeued"
        )
    if "SIGUSR1" not in notice.signals or not warned:
        return False, (
            f"training stopped at step {notice.step} of {notice.max_steps} on "
            f"{', '.join(notice.signals)}, not on this launcher's time-limit warning (scancel, "
            "preemption, a kill): not requeued by distlm-launch; the same command resumes there"
        )
    if max_requeues == 0:
        return False, (
            f"training stopped at step {notice.step} of {notice.max_steps} for the time limit; "
            "requeueing is off (no --max-requeues): the same command resumes there"
        )
    if alloc.restarts >= max_requeues:
        return False, (
            f"training stopped at step {notice.step} of {notice.max_steps} for the time limit "
            f"after {alloc.restarts} requeues of job {alloc.job_id}: --max-requeues="
            f"{max_requeues} reached, not requeued again. Raise --max-requeues in the "
            "train rule's `torchrun` resource (profiles/slurm/config.yaml) or the `runtime`; the "
            "same command resumes from that step"
        )
    return True, (
        f"training stopped at step {notice.step} of {notice.max_steps} for the time limit: "
        f"requeueing job {alloc.job_id} (requeue {alloc.restarts + 1} of at most "
        f"{max_requeues}); its next allocation resumes from step {notice.step}"
    )


def requeue_job(alloc: Allocation) -> int:
    """`scontrol requeue` the job, then wait for SLURM to end this allocation; the exit code if
    it does not (1), or if SLURM refuses the requeue."""
    try:
        scontrol("requeue", alloc.job_id)
    except DistlmError as e:
        say(
            f"could not requeue job {alloc.job_id} ({e}); does the cluster or the job forbid "
            "requeues (JobRequeue=0, --no-requeue)? The same command resumes from the checkpoint"
        )
        return 1
    time.sleep(REQUEUE_WAIT_S)
    say(f"job {alloc.job_id} was requeued but its allocation did not end in {REQUEUE_WAIT_S} s")
    return 1
