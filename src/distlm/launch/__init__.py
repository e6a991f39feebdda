"""Multi-node torchrun inside a SLURM allocation: one `srun` task per node, c10d rendezvous on the
allocation's first node. The SLURM profile sets a rule's `torchrun` resource to this launcher:

    distlm-launch srun-torchrun --nproc-per-node=4 -m distlm.entry.train --config cfg.json

inside a job of N nodes runs

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpus-per-task=C --kill-on-bad-exit=1 --wait=60 \\
        --job-name=distlm-allocation-K python -m distlm.launch torchrun-node \\
        --rdzv-endpoint=HEAD:PORT --rdzv-id=JOBID -- --nproc-per-node=4 -m distlm.entry.train \\
        --config cfg.json

With `srun-torchrun --signal-before=SECONDS`, the launcher reads the job's end time (its time limit)
from `scontrol show job` and, SECONDS before it, sends SIGUSR1 to the job's steps (`scancel
--signal=USR1 JOBID`: every process of every step, never the batch shell where Snakemake runs).
The training ranks then write a checkpoint at the next step boundary and stop (distlm.train); a
rank still starting keeps it from its first line and stops at its first step boundary
(distlm.runtime.stop_latch); a rank whose training is over ignores it, and so do torchrun's agents (each
srun task starts with it ignored, before its Python). This does not
depend on the Snakemake SLURM plugin passing `--signal` to sbatch, nor on SLURM's coarse timing of
it (up to a minute early), and it works for a job whose time limit is raised while it runs (read
again before sending).

With `--max-requeues=N` as well, a training that this warning stopped at a checkpoint is put back
in the queue (`scontrol requeue JOBID`, as submitit does), at most N times per job: the same job id
and name, so the Snakemake SLURM plugin keeps waiting on it (it reads REQUEUED and PENDING as
still active), and the next allocation resumes from that checkpoint. The decision rests on an
explicit signal from the trainer, never on an exit code: the launcher names a file in
DISTLM_STOP_NOTICE, and rank 0 writes a StopNotice document there once the stop's checkpoint is
durable. A failure without a notice (an error, a NaN loss, a bad config) or a stop on another
signal (scancel, preemption: SLURM's own `--requeue` handles the latter) is never requeued. Each
allocation is logged (`allocation K`, SLURM's restart count K-1) and its srun step is named
`distlm-allocation-K` (`squeue -s`, `sacct`).

With `srun-torchrun --spread-procs`, --nproc-per-node is the job's TOTAL process count, spread over
the nodes as evenly as possible (3 on 2 nodes: 2 + 1): for stages whose world size is fixed by the
config (the weight broadcast: 1 sender + receivers), not by the hardware.

Each task execs `python -m torch.distributed.run --nnodes=$SLURM_NNODES --rdzv-backend=c10d
--rdzv-endpoint=HEAD:PORT --rdzv-id=JOBID ...`: world size N x nproc-per-node (OMP_NUM_THREADS
set to the ranks' share of the task's CPUs unless already set).

The rule carries the `mpi` resource so the Snakemake plugin runs its shell in the batch script
itself (not inside `srun -n1`, where this inner step would wait for ever). Snakemake's jobstep
plugin clears SLURM_* except SLURM_JOB_ID, so the allocation (nodes, CPUs per task) is read back
from `scontrol show job`. `--kill-on-bad-exit` ends every node's torchrun when one fails, `--wait`
ends a node still running a minute after another finished, the rendezvous has a join timeout, and
only the head hosts its store (`is_host`, on a port held from the moment it is chosen), so a lost
or stuck node is an error, never a hang.

Modules: `srun` (the srun and torchrun command lines), `slurm` (the allocation, the time-limit
warning), `requeue` (the requeue decision on the trainer's StopNotice); this one is the command.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

from distlm import DistlmError
from distlm.launch.requeue import notice_path, read_notice, requeue_decision, requeue_job
from distlm.launch.slurm import LimitWarning, read_allocation, say
from distlm.launch.srun import (
    check_torchrun_args,
    node_command,
    node_env,
    rendezvous_port,
    srun_command,
)
from distlm.train.documents import STOP_NOTICE_ENV


@dataclass(frozen=True)
class LauncherOptions:
    """The launcher's own options, before the torchrun args."""

    spread_procs: bool = False
    signal_before: float | None = None  # seconds before the time limit to send SIGUSR1
    max_requeues: int = 0  # requeues of the job after a time-limit stop (0: none)


def _launcher_options(args: list[str]) -> tuple[LauncherOptions, list[str]]:
    """(the launcher's options, the torchrun args after them)."""
    spread_procs, before, requeues = False, None, 0
    while args and args[0].startswith(("--spread-procs", "--signal-before", "--max-requeues")):
        opt, eq, value = args[0].partition("=")
        if opt == "--spread-procs" and not eq:
            spread_procs, args = True, args[1:]
            continue
        if opt not in ("--signal-before", "--max-requeues"):
            break
        if not eq and len(args) > 1:
            value, args = args[1], args[1:]
        args = args[1:]
        if opt == "--signal-before":
            try:
                before = float(value)
            except ValueError:
                before = -1.0
            if not before > 0:
                raise DistlmError(
                    f"distlm-launch: --signal-before needs a positive number of seconds, got "
                    f"{value!r}"
                )
        else:
            if not value.isdigit():
                raise DistlmError(
                    f"distlm-launch: --max-requeues needs a whole number >= 0, got {value!r}"
                )
            requeues = int(value)
    if requeues and before is None:
        raise DistlmError(
            "distlm-launch: --max-requeues needs --signal-before: the job is requeued only when "
            "the launcher's own time-limit warning stopped training at a checkpoint"
        )
    return LauncherOptions(spread_procs, before, requeues), args


def srun_torchrun(args: list[str]) -> int:
    """`distlm-launch srun-torchrun`: the srun step of a multi-node torchrun in this allocation,
    the time-limit warning beside it, then the requeue decision on how it ended."""
    opts, args = _launcher_options(args)
    check_torchrun_args(args)
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        raise DistlmError(
            "distlm-launch srun-torchrun runs inside a SLURM allocation but "
            "SLURM_JOB_ID is not set; on one machine use `torchrun --standalone`"
        )
    alloc = read_allocation(job_id)
    port, holder = rendezvous_port(alloc, socket.gethostname())
    warning = LimitWarning(alloc, opts.signal_before) if opts.signal_before else None
    notice = notice_path(alloc)
    env = {
        **os.environ,
        "SLURM_RESTART_COUNT": str(alloc.restarts),
        STOP_NOTICE_ENV: str(notice),
    }
    try:
        notice.unlink(missing_ok=True)
        cmd = srun_command(alloc, args, port=port, spread_procs=opts.spread_procs)
        say(
            f"job {alloc.job_id}, allocation {alloc.restarts + 1} (SLURM restart count "
            f"{alloc.restarts}, at most {opts.max_requeues} requeues on the time limit)"
        )
        say(shlex.join(cmd))
        proc = subprocess.Popen(cmd, env=env)
        if warning is not None:
            warning.start()
        rc = proc.wait()
    finally:
        if warning is not None:
            warning.stop()
        if holder is not None:
            holder.close()
    again, why = requeue_decision(
        alloc,
        opts.max_requeues,
        rc=rc,
        warned=warning is not None and warning.sent.is_set(),
        notice=read_notice(notice),
    )
    if rc != 0:
        say(why)
    if again:
        return requeue_job(alloc)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (
        "usage: distlm-launch srun-torchrun [--spread-procs] [--signal-before=SECONDS] "
        "[--max-requeues=N] [torchrun options] (script.py | -m module) [args]\n"
        "       (inside a SLURM job: one srun task per node, c10d rendezvous on the first)"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{__doc__}\n{usage}")
        return 0 if argv else 2
    try:
        if argv[0] == "srun-torchrun":
            return srun_torchrun(argv[1:])
        if argv[0] == "torchrun-node":
            cmd = node_command(argv[1:], dict(os.environ))
            os.environ.update(node_env(cmd, dict(os.environ)))
            # SIGUSR1 (the time-limit warning) stays ignored through this exec, as the srun task
            # started (srun.TASK_IGNORES_WARNING): torchrun's agent keeps it, the ranks latch it
            os.execv(cmd[0], cmd)
        raise DistlmError(f"distlm-launch: unknown command {argv[0]!r}\n{usage}")
    except DistlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
