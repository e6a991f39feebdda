"""A real SLURM cluster on localhost: munged, slurmctld and one slurmd per node, each node in its
own network namespace (own hostname, own address on a bridge), so multi-node jobs cross a network.

    python tests/harness/slurm_cluster.py up [--nodes 2]    # start (idempotent), wait until idle
    python tests/harness/slurm_cluster.py status
    python tests/harness/slurm_cluster.py env               # `export SLURM_CONF=...` for a shell
    python tests/harness/slurm_cluster.py down              # stop daemons, remove namespaces

Needs root, Debian's slurm-wlm and munge, and iproute2 (.ci/slurm-setup installs them).

Layout (addresses from DISTLM_SLURM_SUBNET, default 10.77.0; names from DISTLM_SLURM_NAME, default
distlm, so a second cluster can run beside the first):
    bridge distlm-br0   10.77.0.1   root namespace: slurmctld, munged, the submitting Snakemake
    netns  distlm-node1 10.77.0.11  hostname node1: slurmd -N node1; jobs and steps run here
    netns  distlm-node2 10.77.0.12  hostname node2: slurmd -N node2
No accounting database: the Snakemake plugin queries squeue, so MinJobAge is large.

The tests (tests/conftest.py) start a cluster of their own session instead (session_cluster: state
in pytest's tmp folder, names from the pid, a free subnet) unless DISTLM_SLURM_STATE names one, and
stop it at the end; `down` also kills what is left in the nodes (slurmstepd, a job's tasks).

Independent of any SLURM or munge already on the machine: its own free ports (SlurmctldPort,
SlurmdPort, chosen at start and kept in its slurm.conf), its own munged (key, socket, pid, log and
seed files), its own state, spool, pid and log paths, all under the state directory
(DISTLM_SLURM_STATE, default /tmp/distlm-slurm). Every command it runs gets SLURM_CONF=its conf and
no other SLURM_*/SBATCH_*/SRUN_*/... variable; the conf names its munge socket (AuthInfo). The nodes
see the conf at /etc/slurm/slurm.conf through bind mounts of /etc/netns/<ns>/ in their own mount
namespace (the jobstep plugin clears SLURM_CONF), so the host's own /etc/slurm is never read or
written. A start that fails at any step stops everything it started and names the step, with the
tails of that daemon's logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PARTITION = "debug"
# A partition over the same nodes whose jobs preempt the default partition's (PriorityTier 2 over
# 1, PreemptMode=REQUEUE): a test preempts a running job by submitting one here.
URGENT_PARTITION = "urgent"
CPUS_PER_NODE = 4  # virtual: SlurmdParameters=config_overrides lets nodes claim more than the host
MEM_PER_NODE_MB = 8000
PORT_RANGE = (
    20000,
    32000,
)  # below Linux's ephemeral range (32768-60999): no outgoing socket has it
REQUIRED = [
    "munged",
    "munge",
    "unmunge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "ip",
    "nsenter",
    "unshare",
]
# Variables that steer SLURM's client commands (sbatch reads SBATCH_*, srun SRUN_* and SLURM_*, ...):
# a shell inside another cluster's job has them; the harness's commands must not see them.
CLIENT_ENV = re.compile(r"^(SLURM|SBATCH|SRUN|SALLOC|SQUEUE|SINFO|SCONTROL|SCANCEL|SACCT|SSTAT)_")
READY_STATES = ("idle", "mix", "alloc", "comp")  # sinfo %t of a node that answers (no "*")


class HarnessError(RuntimeError):
    """The cluster could not be started or checked; the message says which part and why."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    state: Path
    nodes: int
    subnet: str
    name: str = "distlm"  # prefix of the bridge, namespace and veth names (15 characters at most)

    @property
    def conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.state / "munge" / "munge.socket"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br0"

    @property
    def ctl_addr(self) -> str:
        return f"{self.subnet}.1"

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def netns(self, i: int) -> str:
        return f"{self.name}-node{i}"

    def veth(self, i: int) -> str:
        return f"{self.name}-v{i}"

    def ports(self) -> dict[str, int]:
        """SlurmctldPort and SlurmdPort of the running (or last started) cluster, from its conf."""
        try:
            text = self.conf.read_text()
        except FileNotFoundError:
            raise HarnessError(
                f"SLURM harness: no {self.conf}: the cluster was not started"
            ) from None
        found = dict(re.findall(r"^(SlurmctldPort|SlurmdPort)=(\d+)$", text, re.MULTILINE))
        if set(found) != {"SlurmctldPort", "SlurmdPort"}:
            raise HarnessError(f"SLURM harness: {self.conf} has no SlurmctldPort/SlurmdPort line")
        return {k: int(v) for k, v in found.items()}

    def env_changes(self) -> dict[str, str | None]:
        """What to change in this process's environment for a client command (sbatch, squeue,
        snakemake) of this cluster: SLURM_CONF set, every other SLURM client variable removed."""
        out: dict[str, str | None] = {k: None for k in os.environ if CLIENT_ENV.match(k)}
        out["SLURM_CONF"] = str(self.conf)
        return out

    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, squeue, snakemake) in the root namespace."""
        return apply_env(os.environ, self.env_changes())

    def in_node(self, i: int, *cmd: str) -> list[str]:
        """A command line that runs `cmd` inside node i's namespace with its hostname."""
        etc = f"/etc/netns/{self.netns(i)}"
        script = (
            f"hostname {self.node_names()[i - 1]} && mount --bind {etc}/hosts /etc/hosts"
            f" && mount --bind {etc}/resolv.conf /etc/resolv.conf"
            f' && mount --bind {etc}/slurm /etc/slurm && exec "$@"'
        )
        # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs /sys/fs/cgroup.
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns(i)}",
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            script,
            "sh",
            *cmd,
        ]


def apply_env(base, changes: dict[str, str | None]) -> dict[str, str]:
    """`base` with `changes` applied: a None value removes the variable."""
    out = {k: v for k, v in base.items() if k not in changes}
    out.update({k: v for k, v in changes.items() if v is not None})
    return out


def default_cluster(nodes: int | None = None) -> Cluster:
    state = Path(os.environ.get("DISTLM_SLURM_STATE", "/tmp/distlm-slurm"))
    if nodes is None:
        saved = state / "nodes"
        nodes = int(saved.read_text()) if saved.exists() else 2
    return Cluster(
        state=state,
        nodes=nodes,
        subnet=os.environ.get("DISTLM_SLURM_SUBNET", "10.77.0"),
        name=os.environ.get("DISTLM_SLURM_NAME", "distlm"),
    )


def session_cluster(state: Path, nodes: int = 2) -> Cluster:
    """A cluster of one test session's own: its state under `state` (a pytest tmp folder), its
    bridge, namespaces and veths named after this process's pid and a subnet no interface of this
    machine has, so two sessions at once (or a session beside the CLI's default cluster) share no
    daemon, file, name or address."""
    pid = os.getpid()
    return Cluster(state=state, nodes=nodes, subnet=_free_subnet(pid), name=f"dl{pid}")


def _free_subnet(seed: int) -> str:
    """A 10.77.X subnet that no address of this machine is in, X from `seed` on (0 is the CLI's
    default cluster, 9 tests/test_slurm_foreign.py's)."""
    shown = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    used = {int(x) for x in re.findall(r"\binet 10\.77\.(\d+)\.", shown)} | {0, 9}
    for k in range(250):
        x = 10 + (seed + k) % 240
        if x not in used:
            return f"10.77.{x}"
    raise HarnessError("SLURM harness: every 10.77.X subnet is in use on this machine")


def missing_requirements() -> str | None:
    """Why the harness cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the SLURM harness needs root (network namespaces, munged, slurmd)"
    missing = [c for c in REQUIRED if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if missing:
        return (
            f"SLURM harness: {', '.join(missing)} not installed "
            "(run .ci/slurm-setup: apt-get install slurm-wlm munge iproute2)"
        )
    if not Path("/etc/slurm").is_dir():  # the mount point of each node's own /etc/slurm
        return "SLURM harness: no /etc/slurm directory (slurm-wlm's packages create it)"
    return None


def _run(
    cmd: list[str],
    *,
    check: bool = True,
    env: dict | None = None,
    timeout: float = 30,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False, input=input
        )
    except subprocess.TimeoutExpired:
        raise HarnessError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _gone(pid: int) -> bool:
    """The process has exited (reaped here when it is our child, or a zombie of another)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def _ours(c: Cluster, pidfile: Path) -> int | None:
    """The pid in `pidfile` when that process is alive and one of this cluster's daemons (its
    command line names this cluster's state directory), else None: a stale pid file never leads
    to signalling a process of someone else, such as the machine's own slurmctld or munged."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError):
        return None
    if _gone(pid) or not any(str(c.state).encode() in arg for arg in cmdline):
        return None
    return pid


def _daemons(c: Cluster) -> dict[str, Path]:
    """daemon -> the pid file the harness writes when it starts it."""
    out = {"munged": c.state / "pids" / "munged", "slurmctld": c.state / "pids" / "slurmctld"}
    out.update({f"slurmd {n}": c.state / "pids" / f"slurmd-{n}" for n in c.node_names()})
    return out


def _free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """n TCP ports that nothing on this machine listens on or is connected from, from a random
    start in PORT_RANGE (so two clusters started at once do not pick the same ones)."""
    lo, hi = PORT_RANGE
    start = random.randrange(lo, hi)
    found: list[int] = []
    for k in range(hi - lo):
        port = lo + (start - lo + k) % (hi - lo)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise HarnessError(f"SLURM harness: no {n} free TCP ports in {lo}-{hi}")


def slurm_conf(c: Cluster, ports: dict[str, int] | None = None) -> str:
    """The cluster's slurm.conf; `ports` (SlurmctldPort, SlurmdPort) are chosen free when None."""
    if ports is None:
        ctld, slurmd = _free_ports(2)
        ports = {"SlurmctldPort": ctld, "SlurmdPort": slurmd}
    s = c.state
    lines = [
        "# Written by tests/harness/slurm_cluster.py: a localhost test cluster, no accounting.",
        f"ClusterName={c.name}",
        f"SlurmctldHost=ctl({c.ctl_addr})",
        f"SlurmctldPort={ports['SlurmctldPort']}",
        f"SlurmdPort={ports['SlurmdPort']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job (the launcher's `scontrol requeue`, a preemption) is held PENDING
        # (Reason=BeginTime) for cred_expire + 1 s (default 120 s), then waits for the main
        # scheduling loop (sched_interval, default 60 s): SLURM's own delay, not distlm's, which a
        # user's job just waits out. 15 s and 2 s keep each requeue of the tests short; 15 s still
        # gives a step's credential ample time to reach its slurmd on this machine.
        f"AuthInfo=socket={c.munge_socket},cred_expire=15",
        "SchedulerParameters=sched_interval=2",
        f"StateSaveLocation={s}/ctld",
        f"SlurmdSpoolDir={s}/spool/%n",
        f"SlurmctldPidFile={s}/run/slurmctld.pid",
        f"SlurmdPidFile={s}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={s}/log/slurmctld.log",
        f"SlurmdLogFile={s}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",  # no cgroup setup needed on a container/VM
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "MinJobAge=3600",  # jobs stay visible to squeue: the plugin's status source without sacct
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmdTimeout=60",
        "MessageTimeout=20",
        "KillOnBadExit=1",
        "PlugStackConfig=/dev/null",
        # Preemption as clusters do it: a job of the urgent partition requeues the jobs of the
        # default one that hold the nodes it needs (SIGTERM, KillWait, then back to PENDING).
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
    ]
    for i, name in enumerate(c.node_names(), start=1):
        lines.append(
            f"NodeName={name} NodeAddr={c.node_addr(i)} NodeHostname={name} "
            f"CPUs={CPUS_PER_NODE} RealMemory={MEM_PER_NODE_MB} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1"
    )
    lines.append(
        f"PartitionName={URGENT_PARTITION} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 "
        "PreemptMode=OFF"
    )
    return "\n".join(lines) + "\n"


def hosts_file(c: Cluster) -> str:
    rows = ["127.0.0.1 localhost", f"{c.ctl_addr} ctl"]
    rows += [f"{c.node_addr(i)} {n}" for i, n in enumerate(c.node_names(), start=1)]
    return "\n".join(rows) + "\n"


def _network_up(c: Cluster) -> None:
    if _run(["ip", "link", "show", c.bridge], check=False).returncode != 0:
        _run(["ip", "link", "add", c.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{c.ctl_addr}/24", "dev", c.bridge])
    _run(["ip", "link", "set", c.bridge, "up"])
    existing = _run(["ip", "netns", "list"]).stdout
    for i in range(1, c.nodes + 1):
        ns, host_if = c.netns(i), c.veth(i)
        etc = Path("/etc/netns") / ns  # bind-mounted over /etc/hosts and /etc/slurm in the node
        (etc / "slurm").mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file(c))
        # No DNS server is reachable from a node: fail lookups at once instead of timing out.
        (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
        (etc / "hostname").write_text(c.node_names()[i - 1] + "\n")
        shutil.copy(c.conf, etc / "slurm" / "slurm.conf")
        if ns in existing.split():
            continue
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", host_if, "master", c.bridge, "up"])
        _run(
            ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{c.node_addr(i)}/24", "dev", "eth0"]
        )
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"])
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", c.ctl_addr])


def _network_down(c: Cluster) -> None:
    for i in range(1, max(c.nodes, 8) + 1):
        _run(["ip", "netns", "del", c.netns(i)], check=False)
        _run(["ip", "link", "del", c.veth(i)], check=False)
        shutil.rmtree(Path("/etc/netns") / c.netns(i), ignore_errors=True)
    _run(["ip", "link", "del", c.bridge], check=False)


def _spawn(c: Cluster, daemon: str, cmd: list[str], out: Path) -> subprocess.Popen:
    """Start a daemon in the foreground of its own session, record its pid (the command execs
    into the daemon, so the child's pid is the daemon's) for `down`."""
    with open(out, "ab") as sink:
        proc = subprocess.Popen(
            cmd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=c.env(),
        )
    _daemons(c)[daemon].write_text(f"{proc.pid}\n")
    return proc


def _tails(logs: list[Path], lines: int = 15) -> str:
    return "".join(
        f"\n--- {p} (last {lines} lines) ---\n"
        + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        for p in logs
        if p.exists()
    )


def _wait(what: str, ok, timeout: float, procs: dict[str, subprocess.Popen]) -> None:
    """Until ok() holds; fails at once when one of `procs` (daemon -> process) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for daemon, proc in procs.items():
            if proc.poll() is not None:
                raise HarnessError(f"{daemon} exited with code {proc.returncode}")
        if ok():
            return
        time.sleep(0.3)
    raise HarnessError(f"{what} not ready after {timeout:.0f} s")


def _munge_works(c: Cluster) -> bool:
    cred = _run(["munge", "-n", f"--socket={c.munge_socket}"], check=False, timeout=5)
    if cred.returncode != 0:
        return False
    back = _run(
        ["unmunge", f"--socket={c.munge_socket}"], check=False, timeout=5, input=cred.stdout
    )
    return back.returncode == 0


def _node_states(c: Cluster) -> dict[str, str]:
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, env=c.env())
    if proc.returncode != 0:
        return {}
    return dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)


def _idle_nodes(c: Cluster) -> int:
    return sum(1 for s in _node_states(c).values() if s in ("idle", "mix"))


def running(c: Cluster) -> bool:
    """Every daemon of this cluster alive and every node answering the controller."""
    if not all(_ours(c, pf) for pf in _daemons(c).values()):
        return False
    states = _node_states(c)
    return len(states) == c.nodes and all(s in READY_STATES for s in states.values())


def up(c: Cluster) -> Cluster:
    """Start the cluster (or keep the running one) and wait until every node is idle. A start that
    fails stops whatever it had started and raises HarnessError naming the step, with log tails."""
    why = missing_requirements()
    if why:
        raise HarnessError(why)
    s = c.state
    if (s / "nodes").exists() and int((s / "nodes").read_text()) != c.nodes:
        down(dataclasses.replace(c, nodes=int((s / "nodes").read_text())))
    if running(c):
        return c
    down(c)  # what an earlier, interrupted run of this cluster left; never another's daemons
    step, logs = "state directory", []
    try:
        for sub in ("etc", "ctld", "run", "log", "pids", *(f"spool/{n}" for n in c.node_names())):
            (s / sub).mkdir(parents=True, exist_ok=True)
        (s / "nodes").write_text(str(c.nodes))
        c.conf.write_text(slurm_conf(c))
        step, procs = "munged", {}
        procs["munged"] = _munge_up(c)
        logs = [s / "munge" / "munged.log", s / "munge" / "munged.out"]
        _wait("munged", lambda: _munge_works(c), 10, procs)
        step, logs = "network", []
        _network_up(c)
        step, logs = "slurmctld", [s / "log" / "slurmctld.log", s / "log" / "slurmctld.out"]
        # Its own UTS namespace: slurmctld finds itself as `ctl`, whatever this host is called.
        procs["slurmctld"] = _spawn(
            c,
            "slurmctld",
            [
                "unshare",
                "--uts",
                "sh",
                "-c",
                'hostname ctl && exec "$@"',
                "sh",
                _sbin("slurmctld"),
                "-D",
                "-i",
                "-f",
                str(c.conf),
            ],
            s / "log" / "slurmctld.out",
        )
        _wait(
            "slurmctld",
            lambda: "UP" in _run(["scontrol", "ping"], check=False, env=c.env()).stdout,
            30,
            procs,
        )
        step = ", ".join(f"slurmd {n}" for n in c.node_names())
        for i, name in enumerate(c.node_names(), start=1):
            logs += [s / "log" / f"slurmd-{name}.log", s / "log" / f"slurmd-{name}.out"]
            procs[f"slurmd {name}"] = _spawn(
                c,
                f"slurmd {name}",
                c.in_node(i, _sbin("slurmd"), "-D", "-N", name, "-f", str(c.conf)),
                s / "log" / f"slurmd-{name}.out",
            )
        _wait(f"{c.nodes} idle nodes", lambda: _idle_nodes(c) == c.nodes, 60, procs)
    except BaseException as e:
        try:
            down(c)
            stopped = "everything it had started is stopped"
        except Exception as d:  # report both: the start's failure first
            stopped = f"stopping what it had started failed too: {d}"
        if not isinstance(e, (HarnessError, OSError, subprocess.SubprocessError)):
            raise  # KeyboardInterrupt, a bug: cleaned up, then as it was
        raise HarnessError(
            f"SLURM harness ({c.state}): start failed at step {step}: {e}; {stopped}{_tails(logs)}"
        ) from e
    return c


def _munge_up(c: Cluster) -> subprocess.Popen:
    d = c.state / "munge"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    key = d / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    return _spawn(
        c,
        "munged",
        [
            _sbin("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={c.munge_socket}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ],
        d / "munged.out",
    )


def down(c: Cluster) -> None:
    """Stop every daemon this harness started (by the pids it recorded, each checked to be this
    cluster's) and remove the network; nothing else on the machine is signalled."""
    s = c.state
    # the pids it recorded, those of another node count, and the daemons' own pid files
    pidfiles = list(_daemons(c).values()) + sorted((s / "pids").glob("slurmd-*"))
    pidfiles += sorted((s / "run").glob("*.pid")) + [s / "munge" / "munged.pid"]
    if shutil.which("scancel") and _ours(c, _daemons(c)["slurmctld"]):
        try:
            for partition in (PARTITION, URGENT_PARTITION):
                _run(["scancel", "--full", "--partition", partition], check=False, env=c.env())
        except HarnessError:
            pass  # the daemons are stopped below either way
    pids = sorted({pid for pf in pidfiles if (pid := _ours(c, pf))})
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not _gone(pid)]
        time.sleep(0.1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pf in pidfiles:
        pf.unlink(missing_ok=True)
    _kill_node_processes(c)
    _network_down(c)
    for sub in ("ctld", "spool", "run", "pids", "nodes"):
        p = s / sub
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _node_processes(c: Cluster) -> list[int]:
    """Every process inside one of this cluster's node namespaces: what its slurmds started
    (slurmstepd, a job's tasks) and outlived them. Nothing else runs in those namespaces."""
    nets = set()
    for i in range(1, max(c.nodes, 8) + 1):
        try:
            st = os.stat(f"/run/netns/{c.netns(i)}")
        except OSError:
            continue
        nets.add((st.st_dev, st.st_ino))
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = os.stat(d / "ns" / "net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in nets and not _gone(int(d.name)):
            found.append(int(d.name))
    return found


def _kill_node_processes(c: Cluster, within: float = 10) -> None:
    """SIGKILL what is left in the nodes once the daemons are down (a slurmstepd whose slurmd
    exited, a job's tasks), and wait until it is gone; raises HarnessError naming survivors."""
    deadline = time.monotonic() + within
    while pids := _node_processes(c):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise HarnessError(f"SLURM harness: processes {pids} in the nodes outlived SIGKILL")
        time.sleep(0.1)


def status(c: Cluster) -> str:
    return _run(["sinfo", "-N", "-l"], check=False, env=c.env()).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["up", "down", "status", "env"])
    ap.add_argument("--nodes", type=int, default=None, help="slurmd hosts (default 2)")
    args = ap.parse_args(argv)
    c = default_cluster(args.nodes)
    try:
        if args.action == "up":
            up(c)
            print(status(c), end="")
        elif args.action == "down":
            down(c)
        elif args.action == "status":
            print(status(c), end="")
        else:
            print(f"export SLURM_CONF={c.conf}")
            for var in sorted(k for k, v in c.env_changes().items() if v is None):
                print(f"unset {var}")
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
