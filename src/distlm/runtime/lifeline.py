"""Ranks die with their launcher: a rank whose torchrun agent or MPI proxy is gone kills itself.

    from distlm.runtime.lifeline import bind_to_launcher
    bind_to_launcher()        # first thing in every rank (distlm.runtime.dist.distributed() does it)

Two mechanisms, because either alone has a gap:

- `PR_SET_PDEATHSIG` (Linux prctl): the kernel sends SIGKILL to this process the moment its parent
  dies. It follows the parent *thread* that forked the rank (a launcher that spawns from a worker
  thread which later exits would kill its ranks early), it is not inherited across fork, and a
  parent that died before the call is missed.
- A watchdog thread that checks every `poll_s` seconds whether the launcher is still this
  process's parent (`os.getppid()`: a dead parent re-parents its children to init or a
  subreaper), or, for an explicit `launcher_pid` that is not the parent, whether that process
  still exists with the start time it had when bound (pid reuse is not mistaken for life).

Either way the rank dies by SIGKILL within about `poll_s` seconds of its launcher: no orphaned rank
trains on or writes outputs for a job that is gone. The leftovers of any write it had under way are
removed at the next start (distlm.core.io.remove_leftovers).

`bind_to_launcher()` binds only a process started by a launcher (torchrun's TORCHELASTIC_RUN_ID,
or an MPI rank's PMI/PMIx/Open MPI variables); a plain process (a test, a world of one) is left
alone. `bind_to_launcher(force=True)` binds any process to its parent.

Under SLURM, srun's step daemon (slurmstepd) ends every process of a task when the step ends or
srun dies; the lifeline adds the case it misses, a launcher inside the task (torchrun's agent, the
MPI proxy) dying while the task goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

from distlm.core.log import get_logger

log = get_logger(__name__)

PR_SET_PDEATHSIG = 1
# Environment variables that only a launcher's children have.
LAUNCHER_ENV = (
    "TORCHELASTIC_RUN_ID",  # torchrun
    "PMI_RANK",  # MPICH / hydra
    "PMIX_RANK",  # PMIx (Open MPI 5, srun --mpi=pmix)
    "OMPI_COMM_WORLD_RANK",  # Open MPI
)


@dataclass(frozen=True)
class Lifeline:
    """What this process is bound to (returned by bind_to_launcher, for logs and tests)."""

    launcher_pid: int
    pdeathsig: bool  # whether the kernel's parent-death signal is set
    poll_s: float


_bound: Lifeline | None = None
_lock = threading.Lock()


def launched() -> bool:
    """Whether this process was started by torchrun or an MPI launcher."""
    return any(k in os.environ for k in LAUNCHER_ENV)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return stat.rsplit(")", 1)[1].split()[19]


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die(why: str) -> None:
    log.error("%s: this rank exits (SIGKILL)", why)
    for h in logging.getLogger("distlm").handlers:
        with contextlib.suppress(Exception):  # dying anyway: a broken handler must not stop it
            h.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(launcher_pid: int, is_parent: bool, started: str | None, poll_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll_s):
        if is_parent:
            gone = os.getppid() != launcher_pid
        else:
            gone = _start_time(launcher_pid) != started
        if gone:
            _die(f"launcher pid {launcher_pid} is gone")


def bind_to_launcher(
    launcher_pid: int | None = None, *, poll_s: float = 1.0, force: bool = False
) -> Lifeline | None:
    """Make this process die within ~poll_s seconds of its launcher (default: its parent).

    Returns the binding, or None for a process no launcher started (unless `force`). Idempotent:
    a second call returns the first binding.
    """
    global _bound
    with _lock:
        if _bound is not None:
            return _bound
        if not force and launcher_pid is None and not launched():
            log.debug("no launcher in the environment: lifeline not bound")
            return None
        parent = os.getppid()
        pid = parent if launcher_pid is None else launcher_pid
        is_parent = pid == parent
        started = None if is_parent else _start_time(pid)
        pdeathsig = is_parent and _set_pdeathsig(signal.SIGKILL)
        # The parent may have died before prctl: then we are already init's (or a subreaper's).
        if is_parent and (os.getppid() != pid or pid == 1):
            _die(f"launcher pid {pid} died before the lifeline was bound")
        if not is_parent and started is None:
            _die(f"launcher pid {pid} is not running")
        threading.Thread(
            target=_watch,
            args=(pid, is_parent, started, poll_s),
            name="distlm-lifeline",
            daemon=True,
        ).start()
        _bound = Lifeline(launcher_pid=pid, pdeathsig=pdeathsig, poll_s=poll_s)
        log.debug("lifeline bound to launcher pid %d (pdeathsig %s)", pid, pdeathsig)
        return _bound
