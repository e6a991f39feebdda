"""What the launcher reads from SLURM and sends it: the allocation (`scontrol show job`, read back
because Snakemake's jobstep plugin clears SLURM_* but SLURM_JOB_ID) and the time-limit warning
(SIGUSR1 to the job's steps `--signal-before` seconds before its end time)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from distlm import DistlmError


def say(msg: str) -> None:
    """One line of the launcher's own log (the rule's log, through stderr)."""
    print(f"distlm-launch: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Allocation:
    """The parts of a SLURM job this launcher needs."""

    job_id: str
    hosts: tuple[str, ...]
    cpus_per_task: int
    end_time: float | None = None  # epoch seconds the time limit ends the job; None: no limit
    restarts: int = 0  # times SLURM requeued the job (`Restarts`, SLURM_RESTART_COUNT)

    @property
    def head(self) -> str:
        return self.hosts[0]


def parse_job(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {field: value} (spaced values are cut; none needed)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", text))


def parse_end_time(value: str | None) -> float | None:
    """`EndTime=2026-11-22T19:30:00` (the controller's local time) -> epoch seconds."""
    if not value or value in ("Unknown", "None", "(null)"):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def scontrol(*args: str, run=subprocess.run) -> str:
    """`scontrol ARGS`' output, or DistlmError with the command and SLURM's message."""
    cmd = ["scontrol", *args]
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise DistlmError(f"distlm-launch: `scontrol` not found on PATH ({e})") from e
    if proc.returncode != 0:
        raise DistlmError(f"distlm-launch: `{shlex.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def read_allocation(job_id: str, *, run=subprocess.run) -> Allocation:
    fields = parse_job(scontrol("show", "job", "-o", job_id, run=run))
    nodelist = fields.get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        raise DistlmError(f"distlm-launch: SLURM job {job_id} has no NodeList (is it running?)")
    hosts = tuple(scontrol("show", "hostnames", nodelist, run=run).split())
    cpus = fields.get("CPUs/Task", "1")
    restarts = fields.get("Restarts", "0")
    return Allocation(
        job_id=job_id,
        hosts=hosts,
        cpus_per_task=int(cpus) if cpus.isdigit() else 1,
        end_time=parse_end_time(fields.get("EndTime")),
        restarts=int(restarts) if restarts.isdigit() else 0,
    )


# The warning is sent again this often until the steps end: a step, or a rank, that starts after a
# send would not have it (a rank keeps one that comes while it starts: distlm.runtime.stop_latch).
RESEND_S = 5.0


class LimitWarning:
    """SIGUSR1 to the job's steps `before_s` seconds before its time limit (`scancel
    --signal=USR1 JOBID`: every process of every step, never the batch shell where Snakemake
    runs), then every RESEND_S seconds until `stop()`. The limit is read again before sending: a
    limit raised meanwhile moves the warning."""

    def __init__(self, alloc: Allocation, before_s: float) -> None:
        self.alloc = alloc
        self.before_s = before_s
        self._done = threading.Event()
        self.sent = threading.Event()  # SIGUSR1 went to the job's steps
        self._thread = threading.Thread(target=self._run, daemon=True, name="limit-warning")

    def start(self) -> None:
        if self.alloc.end_time is None:
            say(f"job {self.alloc.job_id} has no time limit: no SIGUSR1 to send")
            return
        self._thread.start()

    def _run(self) -> None:
        end = self.alloc.end_time
        while end is not None:
            if self._done.wait(max(0.0, min(60.0, end - self.before_s - time.time()))):
                return
            if time.time() < end - self.before_s:
                continue
            try:  # the limit may have been raised meanwhile
                fresh = parse_job(scontrol("show", "job", "-o", self.alloc.job_id))
                end_now = parse_end_time(fresh.get("EndTime"))
            except DistlmError:
                end_now = end
            if end_now is not None and end_now > end + 1:
                end = end_now
                continue
            left = end - time.time()
            say(
                f"job {self.alloc.job_id} reaches its time limit in {left:.0f} s: "
                f"SIGUSR1 to its steps (the training ranks checkpoint and stop), again every "
                f"{RESEND_S:.0f} s until they end"
            )
            while True:
                sent = subprocess.run(
                    ["scancel", "--signal=USR1", self.alloc.job_id],
                    check=False,
                    timeout=60,
                    capture_output=self.sent.is_set(),  # the repeats are quiet
                )
                if sent.returncode == 0:
                    self.sent.set()
                if self._done.wait(RESEND_S):
                    return

    def stop(self) -> None:
        self._done.set()
