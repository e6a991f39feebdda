"""The command lines of a multi-node torchrun: the `srun` step the launcher starts (one task per
node) and the torchrun each task execs, with c10d rendezvous on the allocation's first node.

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpus-per-task=C --kill-on-bad-exit=1 --wait=60 \\
        --job-name=distlm-allocation-K python -m distlm.launch torchrun-node \\
        --rdzv-endpoint=HEAD:PORT --rdzv-id=JOBID -- --nproc-per-node=4 -m distlm.entry.train ...

Each task execs `python -m torch.distributed.run --nnodes=$SLURM_NNODES --rdzv-backend=c10d
--rdzv-endpoint=HEAD:PORT --rdzv-id=JOBID ...` (`node_command`): world size N x nproc-per-node.
`--spread-procs` spreads a TOTAL process count over the nodes (`spread`). `--kill-on-bad-exit`
ends every node's torchrun when one fails, `--wait` ends a node still running a minute after
another finished, the rendezvous has a join timeout, and only the head hosts its store
(`is_host`, on a port held from the moment it is chosen), so a lost or stuck node is an error,
never a hang.
"""

from __future__ import annotations

import re
import socket
import sys

from distlm import DistlmError
from distlm.launch.slurm import Allocation

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


# Each srun task starts with the time-limit warning (SIGUSR1) ignored, before its Python: the
# launcher sends it again every few seconds (distlm.launch.slurm.LimitWarning), and one that came
# while the task's Python was still importing would kill it (SIGUSR1's default action), and
# srun's --kill-on-bad-exit the whole step, without a checkpoint. SIG_IGN survives exec: torchrun's
# agent keeps it (it would die of the warning too), the ranks latch it (distlm.runtime.stop_latch).
TASK_IGNORES_WARNING = ("/bin/sh", "-c", 'trap "" USR1; exec "$@"', "distlm-launch-task")


def srun_command(
    alloc: Allocation,
    torchrun_args: list[str],
    *,
    port: int,
    python: str = sys.executable,
    spread_procs: bool = False,
) -> list[str]:
    n = len(alloc.hosts)
    if spread_procs and not _per_gpu(torchrun_args):
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
        *TASK_IGNORES_WARNING,
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
    if _per_gpu(args):  # one rank per GPU: resolved here, so a node without one names the key
        args = _set_nproc(args, gpus_here(env))
    elif "--spread-procs" in own:
        total = _nproc_at(args)[1]
        args = _set_nproc(args, spread(total, int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])))
    own = [a for a in own if a != "--spread-procs"]
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


def _per_gpu(args: list[str]) -> bool:
    """--nproc-per-node=gpu: one rank per GPU of the node (a stage's null count)."""
    found = _torchrun_option(args, ("--nproc-per-node", "--nproc_per_node"))
    return found is not None and found[2] == "gpu"


def _set_nproc(args: list[str], n: int) -> list[str]:
    i, at, _ = _torchrun_option(args, ("--nproc-per-node", "--nproc_per_node")) or (0, 0, "")
    return args[:i] + [f"--nproc-per-node={n}"] + args[at + 1 :]


def gpus_here(env: dict[str, str]) -> int:
    """The GPUs this node's ranks would see; none is an error naming the keys that asked
    (distlm.runtime.machine.ranks_problem)."""
    from distlm.runtime.machine import ranks_problem, visible_gpus

    n = visible_gpus(env)
    problem = ranks_problem(
        None,
        n,
        key="train.nproc_per_node, eval.nproc_per_node or broadcast.receivers",
        where=f"node {env.get('SLURMD_NODENAME') or socket.gethostname()}",
        seen=f" (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})",
        fix=", or give the rule GPUs (gres)",
    )
    if problem:
        raise DistlmError(problem)
    return n


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
