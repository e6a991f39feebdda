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
The training ranks then write a checkpoint at the next step boundary and stop (distlm.train);
torchrun's agents ignore SIGUSR1 (set before they start). This does not depend on the Snakemake
SLURM plugin passing `--signal` to sbatch, nor on SLURM's coarse timing of it (up to a minute
early), and it works for a job whose time limit is raised while it runs (read again before
sending).

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
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from distlm import DistlmError
from distlm.documents import STOP_NOTICE_ENV, StopNotice, read_document

# torchrun options this launcher decides: given by the caller they would contradict the allocation.
_OWNED = (
    "--standalone",
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-id",
    "--rdzv_id",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)
DEFAULT_JOIN_TIMEOUT_S = 300
# srun --wait: once one node's torchrun has exited, the others get this long before srun ends them.
# torchrun's agents leave together (their exit barrier waits up to 300 s for the slowest node), so
# this only bounds a node that hangs after its peers are done; SLURM's default waits for ever.
STRAGGLER_WAIT_S = 60


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


def _scontrol(*args: str, run=subprocess.run) -> str:
    cmd = ["scontrol", *args]
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise DistlmError(f"distlm-launch: `scontrol` not found on PATH ({e})") from e
    if proc.returncode != 0:
        raise DistlmError(f"distlm-launch: `{shlex.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def read_allocation(job_id: str, *, run=subprocess.run) -> Allocation:
    def scontrol(*args: str) -> str:
        return _scontrol(*args, run=run)

    fields = parse_job(scontrol("show", "job", "-o", job_id))
    nodelist = fields.get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        raise DistlmError(f"distlm-launch: SLURM job {job_id} has no NodeList (is it running?)")
    hosts = tuple(scontrol("show", "hostnames", nodelist).split())
    cpus = fields.get("CPUs/Task", "1")
    restarts = fields.get("Restarts", "0")
    return Allocation(
        job_id=job_id,
        hosts=hosts,
        cpus_per_task=int(cpus) if cpus.isdigit() else 1,
        end_time=parse_end_time(fields.get("EndTime")),
        restarts=int(restarts) if restarts.isdigit() else 0,
    )


def check_torchrun_args(args: list[str]) -> None:
    """Refuse a missing script and the torchrun options the launcher owns (before the script)."""
    script_at = next((i for i, a in enumerate(args) if a.endswith(".py") or a == "-m"), None)
    if script_at is None:
        raise DistlmError(
            "distlm-launch srun-torchrun: no script.py given (usage: distlm-launch "
            "srun-torchrun [torchrun options] script.py [script args])"
        )
    for a in args[:script_at]:
        if a.split("=", 1)[0] in _OWNED:
            raise DistlmError(
                f"distlm-launch srun-torchrun: torchrun option {a.split('=', 1)[0]} is set by the "
                "launcher from the SLURM allocation (nodes, rendezvous); remove it from the "
                "`torchrun` resource or the rule"
            )


def rendezvous_port(alloc: Allocation, hostname: str) -> tuple[int, socket.socket | None]:
    """The c10d port, and on the head node (the batch host) a socket that holds it.

    On the head: a free port, kept bound (SO_REUSEADDR, not listening) until the step ends, so no
    other process's bind or ephemeral port can take it in the seconds before the head's torchrun
    listens on it (TCPStore also binds with SO_REUSEADDR, which a non-listening holder allows).
    Elsewhere: one derived from the job id (and nothing to hold: the head is another machine)."""
    if hostname in (alloc.head, alloc.head.split(".")[0]):
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", 0))
        return holder.getsockname()[1], holder
    return 20000 + int(re.sub(r"\D", "", alloc.job_id) or 0) % 20000, None


def _torchrun_option(args: list[str], names: tuple[str, ...]) -> tuple[int, int, str] | None:
    """(index of the option, index of its value, value) of the first of `names` among torchrun's
    options (before the script), as `--name=value` or `--name value`; None when absent."""
    for i, a in enumerate(args):
        if a.endswith(".py") or a == "-m":
            return None
        name, eq, value = a.partition("=")
        if name in names:
            if eq:
                return i, i, value
            if i + 1 >= len(args):
                raise DistlmError(f"distlm-launch: {name} needs a value")
            return i, i + 1, args[i + 1]
    return None


def _nproc_at(args: list[str]) -> tuple[int, int]:
    """(index, value) of --nproc-per-node in torchrun's options (before the script)."""
    found = _torchrun_option(args, ("--nproc-per-node", "--nproc_per_node"))
    if found is None:
        raise DistlmError(
            "distlm-launch --spread-procs: the torchrun options have no --nproc-per-node"
        )
    i, _, val = found
    if not val.isdigit() or int(val) < 1:
        raise DistlmError(f"distlm-launch: {args[i]} {val} needs a positive process count")
    return i, int(val)


def spread(total: int, nodes: int, node: int) -> int:
    """Processes on node `node` of `nodes` when `total` are spread evenly (the first get more)."""
    if total < nodes:
        raise DistlmError(
            f"distlm-launch --spread-procs: {total} processes cannot cover "
            f"{nodes} nodes; ask for at most {total} nodes for this rule"
        )
    return total // nodes + (1 if node < total % nodes else 0)


def srun_command(
    alloc: Allocation,
    torchrun_args: list[str],
    *,
    port: int,
    python: str = sys.executable,
    spread_procs: bool = False,
) -> list[str]:
    n = len(alloc.hosts)
    if spread_procs:
        spread(_nproc_at(torchrun_args)[1], n, 0)  # refuse too many nodes before starting any
    rdzv = [f"--rdzv-endpoint={alloc.head}:{port}", f"--rdzv-id={alloc.job_id}"]
    if _torchrun_option(torchrun_args, ("--rdzv-conf", "--rdzv_conf")) is None:
        rdzv.append(f"--rdzv-conf=join_timeout={DEFAULT_JOIN_TIMEOUT_S}")
    return [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={alloc.cpus_per_task}",
        "--kill-on-bad-exit=1",
        f"--wait={STRAGGLER_WAIT_S}",
        # the step's name in `squeue -s` and `sacct`: which allocation of the job this is
        f"--job-name=distlm-allocation-{alloc.restarts + 1}",
        python,
        "-m",
        "distlm.launch",
        "torchrun-node",
        *(["--spread-procs"] if spread_procs else []),
        *rdzv,
        "--",
        *torchrun_args,
    ]


def node_command(
    argv: list[str], env: dict[str, str], *, python: str = sys.executable
) -> list[str]:
    """The torchrun line of one srun task: node count and rank from srun's task environment."""
    if "--" not in argv:
        raise DistlmError("distlm-launch torchrun-node: expected `-- <torchrun args>`")
    cut = argv.index("--")
    own, args = argv[:cut], argv[cut + 1 :]
    need = ("SLURM_NNODES", "SLURM_NODEID") if "--spread-procs" in own else ("SLURM_NNODES",)
    missing = [v for v in need if v not in env]
    if missing:
        raise DistlmError(
            f"distlm-launch torchrun-node runs as an srun task; {', '.join(missing)} not set"
        )
    if "--spread-procs" in own:
        own = [a for a in own if a != "--spread-procs"]
        i, total = _nproc_at(args)
        here = spread(total, int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"]))
        args = args[:i] + [f"--nproc-per-node={here}"] + args[i + (1 if "=" in args[i] else 2) :]
    own, args = _with_is_host(own, args, env)
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={env['SLURM_NNODES']}",
        "--rdzv-backend=c10d",
        *own,
        *args,
    ]


def _with_is_host(
    own: list[str], args: list[str], env: dict[str, str]
) -> tuple[list[str], list[str]]:
    """`is_host` in the rendezvous config: true on the endpoint's node, false elsewhere.

    Left to itself, torchrun guesses from the hostname and, when the head cannot bind the port,
    quietly joins as a client of whatever listens there. Told, the head fails at once instead."""
    endpoint = next((a.split("=", 1)[1] for a in own if a.startswith("--rdzv-endpoint=")), None)
    if endpoint is None:
        return own, args
    head = endpoint.rsplit(":", 1)[0]
    here = env.get("SLURMD_NODENAME") or socket.gethostname()
    flag = f"is_host={str(here in (head, head.split('.')[0])).lower()}"
    for where in ("own", "args"):
        opts = list(own if where == "own" else args)
        found = _torchrun_option(opts, ("--rdzv-conf", "--rdzv_conf"))
        if found is None:
            continue
        i, at, value = found
        if "is_host" in value:
            raise DistlmError(
                f"distlm-launch: {opts[i].split('=')[0]} {value} sets is_host, which the launcher "
                "decides per node (true on the rendezvous head); remove it"
            )
        opts[at] = f"{opts[at]},{flag}"
        return (opts, args) if where == "own" else (own, opts)
    return [*own, f"--rdzv-conf={flag}"], args


def node_env(cmd: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment the node's torchrun adds to srun's.

    OMP_NUM_THREADS: the ranks' share of the CPUs SLURM gave this task. torchrun sets 1 only when
    it starts several ranks; a lone rank would otherwise use every core of the machine, not its
    allocation (and a different thread count changes float results).
    LOGLEVEL=INFO: torchrun's agent then logs its rendezvous (who hosts the store, the world it
    joined) and its exit barrier into the rule's log, so a stuck multi-node step says where."""
    out = {} if "LOGLEVEL" in env else {"LOGLEVEL": "INFO"}
    if "OMP_NUM_THREADS" in env:
        return out
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    try:
        nproc = _nproc_at(cmd[3:])[1]
    except DistlmError:  # "auto"/"gpu" or absent: leave it to torchrun
        return out
    if cpus.isdigit():
        out["OMP_NUM_THREADS"] = str(max(1, int(cpus) // nproc))
    return out


class LimitWarning:
    """SIGUSR1 to the job's steps `before_s` seconds before its time limit (see the docstring)."""

    def __init__(self, alloc: Allocation, before_s: float) -> None:
        self.alloc = alloc
        self.before_s = before_s
        self._done = threading.Event()
        self.sent = threading.Event()  # SIGUSR1 went to the job's steps
        self._thread = threading.Thread(target=self._run, daemon=True, name="limit-warning")

    def start(self) -> None:
        if self.alloc.end_time is None:
            print(
                f"distlm-launch: job {self.alloc.job_id} has no time limit: no SIGUSR1 to send",
                file=sys.stderr,
                flush=True,
            )
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
                fresh = parse_job(_scontrol("show", "job", "-o", self.alloc.job_id))
                end_now = parse_end_time(fresh.get("EndTime"))
            except DistlmError:
                end_now = end
            if end_now is not None and end_now > end + 1:
                end = end_now
                continue
            left = end - time.time()
            print(
                f"distlm-launch: job {self.alloc.job_id} reaches its time limit in {left:.0f} s: "
                "SIGUSR1 to its steps (the training ranks checkpoint and stop)",
                file=sys.stderr,
                flush=True,
            )
            sent = subprocess.run(
                ["scancel", "--signal=USR1", self.alloc.job_id], check=False, timeout=60
            )
            if sent.returncode == 0:
                self.sent.set()
            return

    def stop(self) -> None:
        self._done.set()


# The trainer -> launcher signal that decides a requeue. The launcher names a file in this variable
# (in the job's working directory, shared by every node); rank 0 of a training that stopped on a
# signal at a step boundary writes a StopNotice there once that step's checkpoint is durable
# (distlm.train.stopping). Only a notice that names SIGUSR1, after the launcher itself sent it
# (--signal-before), makes the launcher requeue the job. No notice (an error, a NaN loss, a bad
# config, a killed rank) or another signal (scancel's or preemption's SIGTERM) never does.
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


def notice_path(alloc: Allocation, cwd: Path | None = None) -> Path:
    """Where the trainer's StopNotice goes: the job's working directory, which every node shares
    (the SLURM plugin's logs and the results live there too), one file per job and allocation
    (no folder of its own: nothing that one job removes while another writes there)."""
    base = Path.cwd() if cwd is None else cwd
    return base / f".distlm-launch-job-{alloc.job_id}-allocation-{alloc.restarts + 1}.stop.json"


def _say(msg: str) -> None:
    print(f"distlm-launch: {msg}", file=sys.stderr, flush=True)


def requeue_decision(
    alloc: Allocation, opts: LauncherOptions, *, rc: int, warned: bool, notice: StopNotice | None
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
    if opts.max_requeues == 0:
        return False, (
            f"training stopped at step {notice.step} of {notice.max_steps} for the time limit; "
            "requeueing is off (no --max-requeues): the same command resumes there"
        )
    if alloc.restarts >= opts.max_requeues:
        return False, (
            f"training stopped at step {notice.step} of {notice.max_steps} for the time limit "
            f"after {alloc.restarts} requeues of job {alloc.job_id}: --max-requeues="
            f"{opts.max_requeues} reached, not requeued again. Raise --max-requeues in the "
            "train rule's `torchrun` resource (profiles/slurm/config.yaml) or the `runtime`; the "
            "same command resumes from that step"
        )
    return True, (
        f"training stopped at step {notice.step} of {notice.max_steps} for the time limit: "
        f"requeueing job {alloc.job_id} (requeue {alloc.restarts + 1} of at most "
        f"{opts.max_requeues}); its next allocation resumes from step {notice.step}"
    )


def _read_notice(path: Path) -> StopNotice | None:
    """The notice at `path`, if the trainer wrote one; the file is removed either way."""
    if not path.exists():
        return None
    try:
        return read_document(path, StopNotice)
    finally:
        path.unlink(missing_ok=True)


# After `scontrol requeue`, SLURM ends this allocation (SIGTERM to the batch script, then SIGKILL
# after KillWait); the launcher waits for that rather than exiting first.
REQUEUE_WAIT_S = 300


def _requeue(alloc: Allocation) -> int:
    try:
        _scontrol("requeue", alloc.job_id)
    except DistlmError as e:
        _say(
            f"could not requeue job {alloc.job_id} ({e}); does the cluster or the job forbid "
            "requeues (JobRequeue=0, --no-requeue)? The same command resumes from the checkpoint"
        )
        return 1
    time.sleep(REQUEUE_WAIT_S)
    _say(f"job {alloc.job_id} was requeued but its allocation did not end in {REQUEUE_WAIT_S} s")
    return 1


def srun_torchrun(args: list[str]) -> int:
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
        _say(
            f"job {alloc.job_id}, allocation {alloc.restarts + 1} (SLURM restart count "
            f"{alloc.restarts}, at most {opts.max_requeues} requeues on the time limit)"
        )
        _say(shlex.join(cmd))
        proc = subprocess.Popen(cmd, env=env)
        if warning is not None:
            warning.start()
        rc = proc.wait()
    finally:
        if warning is not None:
            warning.stop()
        if holder is not None:
            holder.close()
    requeue, why = requeue_decision(
        alloc,
        opts,
        rc=rc,
        warned=warning is not None and warning.sent.is_set(),
        notice=_read_notice(notice),
    )
    if rc != 0:
        _say(why)
    if requeue:
        return _requeue(alloc)
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
            # torchrun's agent would die of SIGUSR1 (the time-limit warning): ignored here, the
            # disposition survives exec; the training ranks install their own handler.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            os.execv(cmd[0], cmd)
        raise DistlmError(f"distlm-launch: unknown command {argv[0]!r}\n{usage}")
    except DistlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
