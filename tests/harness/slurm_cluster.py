"""A real SLURM cluster on localhost: munged, slurmctld and one slurmd per node, each node in its
own network namespace (own hostname, own address on a bridge), so multi-node jobs cross a network.

    python tests/harness/slurm_cluster.py up [--nodes 2]    # start (idempotent), wait until idle
    python tests/harness/slurm_cluster.py status
    python tests/harness/slurm_cluster.py env               # `export SLURM_CONF=...` for a shell
    python tests/harness/slurm_cluster.py down              # stop daemons, remove namespaces

Needs root, Debian's slurm-wlm and munge, and iproute2 (.ci/slurm-setup installs them).

Layout (addresses from DISTLM_SLURM_SUBNET, default 10.77.0):
    bridge distlm-br0   10.77.0.1   root namespace: slurmctld, munged, the submitting Snakemake
    netns  distlm-node1 10.77.0.11  hostname node1: slurmd -N node1; jobs and steps run here
    netns  distlm-node2 10.77.0.12  hostname node2: slurmd -N node2
No accounting database: the Snakemake plugin queries squeue, so MinJobAge is large. Every file lives
under the state directory (DISTLM_SLURM_STATE, default /tmp/distlm-slurm); the nodes see the config
at /etc/slurm/slurm.conf through `ip netns exec`'s /etc/netns/<ns>/ bind mounts (the jobstep plugin
clears SLURM_CONF), so the host's own /etc/slurm is never touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BRIDGE = "distlm-br0"
PARTITION = "debug"
CPUS_PER_NODE = 4  # virtual: SlurmdParameters=config_overrides lets nodes claim more than the host
MEM_PER_NODE_MB = 8000
REQUIRED = [
    "munged",
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


class HarnessError(RuntimeError):
    """The cluster could not be started or checked; the message says which part and why."""


@dataclass(frozen=True)
class Cluster:
    state: Path
    nodes: int
    subnet: str

    @property
    def conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.state / "munge" / "munge.socket"

    @property
    def ctl_addr(self) -> str:
        return f"{self.subnet}.1"

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def netns(self, i: int) -> str:
        return f"distlm-node{i}"

    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, squeue, snakemake) in the root namespace."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

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


def default_cluster(nodes: int | None = None) -> Cluster:
    state = Path(os.environ.get("DISTLM_SLURM_STATE", "/tmp/distlm-slurm"))
    if nodes is None:
        saved = state / "nodes"
        nodes = int(saved.read_text()) if saved.exists() else 2
    return Cluster(
        state=state, nodes=nodes, subnet=os.environ.get("DISTLM_SLURM_SUBNET", "10.77.0")
    )


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
    return None


def _run(
    cmd: list[str], *, check: bool = True, env: dict | None = None, timeout: float = 30
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False


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


def slurm_conf(c: Cluster) -> str:
    s = c.state
    lines = [
        "# Written by tests/harness/slurm_cluster.py: a localhost test cluster, no accounting.",
        "ClusterName=distlm",
        f"SlurmctldHost=ctl({c.ctl_addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={c.munge_socket}",
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
    ]
    for i, name in enumerate(c.node_names(), start=1):
        lines.append(
            f"NodeName={name} NodeAddr={c.node_addr(i)} NodeHostname={name} "
            f"CPUs={CPUS_PER_NODE} RealMemory={MEM_PER_NODE_MB} State=UNKNOWN"
        )
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def hosts_file(c: Cluster) -> str:
    rows = ["127.0.0.1 localhost", f"{c.ctl_addr} ctl"]
    rows += [f"{c.node_addr(i)} {n}" for i, n in enumerate(c.node_names(), start=1)]
    return "\n".join(rows) + "\n"


def _network_up(c: Cluster) -> None:
    if _run(["ip", "link", "show", BRIDGE], check=False).returncode != 0:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{c.ctl_addr}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    existing = _run(["ip", "netns", "list"]).stdout
    for i in range(1, c.nodes + 1):
        ns, host_if = c.netns(i), f"distlm-v{i}"
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
        _run(["ip", "link", "set", host_if, "master", BRIDGE, "up"])
        _run(
            ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{c.node_addr(i)}/24", "dev", "eth0"]
        )
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"])
        _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", c.ctl_addr])


def _network_down(c: Cluster) -> None:
    for i in range(1, max(c.nodes, 8) + 1):
        _run(["ip", "netns", "del", c.netns(i)], check=False)
        _run(["ip", "link", "del", f"distlm-v{i}"], check=False)
        shutil.rmtree(Path("/etc/netns") / c.netns(i), ignore_errors=True)
    _run(["ip", "link", "del", BRIDGE], check=False)


def _spawn(cmd: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait(what: str, ok, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.3)
    tails = "".join(
        f"\n--- {p} ---\n" + "\n".join(p.read_text().splitlines()[-15:]) for p in logs if p.exists()
    )
    raise HarnessError(f"SLURM harness: {what} not ready after {timeout:.0f} s{tails}")


def _munge_up(c: Cluster) -> None:
    d = c.state / "munge"
    pid = d / "munged.pid"
    if _alive(pid):
        return
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    key = d / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    _run(
        [
            _sbin("munged"),
            "--force",
            f"--key-file={key}",
            f"--socket={c.munge_socket}",
            f"--pid-file={pid}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ]
    )
    _wait("munged", lambda: c.munge_socket.exists(), 10, [d / "munged.log"])


def _idle_nodes(c: Cluster) -> int:
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, env=c.env())
    if proc.returncode != 0:
        return 0
    return sum(1 for line in proc.stdout.splitlines() if line.split()[1:2] in (["idle"], ["mix"]))


def running(c: Cluster) -> bool:
    """Every daemon of this cluster alive and every node idle (or partly allocated)."""
    pids = [c.state / "munge" / "munged.pid", c.state / "run" / "slurmctld.pid"]
    pids += [c.state / "run" / f"slurmd-{n}.pid" for n in c.node_names()]
    return all(_alive(p) for p in pids) and _idle_nodes(c) == c.nodes


def up(c: Cluster) -> Cluster:
    """Start the cluster (or keep the running one) and wait until every node is idle."""
    why = missing_requirements()
    if why:
        raise HarnessError(why)
    s = c.state
    if (s / "nodes").exists() and int((s / "nodes").read_text()) != c.nodes:
        down(default_cluster())
    for sub in ("etc", "ctld", "run", "log", *(f"spool/{n}" for n in c.node_names())):
        (s / sub).mkdir(parents=True, exist_ok=True)
    (s / "nodes").write_text(str(c.nodes))
    c.conf.write_text(slurm_conf(c))
    _munge_up(c)
    _network_up(c)
    logs = [s / "log" / "slurmctld.log"]
    if not _alive(s / "run" / "slurmctld.pid"):
        # Its own UTS namespace: slurmctld finds itself as `ctl`, whatever this host is called.
        _spawn(
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
            lambda: _run(["scontrol", "ping"], check=False, env=c.env()).stdout.count("UP") > 0,
            30,
            logs,
        )
    for i, name in enumerate(c.node_names(), start=1):
        logs.append(s / "log" / f"slurmd-{name}.log")
        if not _alive(s / "run" / f"slurmd-{name}.pid"):
            _spawn(
                c.in_node(i, _sbin("slurmd"), "-D", "-N", name, "-f", "/etc/slurm/slurm.conf"),
                s / "log" / f"slurmd-{name}.out",
            )
    _wait(f"{c.nodes} idle nodes", lambda: _idle_nodes(c) == c.nodes, 60, logs)
    return c


def down(c: Cluster) -> None:
    """Stop every daemon this harness started (by its pid file) and remove the network."""
    s = c.state
    if shutil.which("scancel") and (s / "run" / "slurmctld.pid").exists():
        _run(["scancel", "--full", "--partition", PARTITION], check=False, env=c.env())
    pidfiles = sorted((s / "run").glob("slurmd-*.pid")) + [
        s / "run" / "slurmctld.pid",
        s / "munge" / "munged.pid",
    ]
    pids = [int(pf.read_text().strip()) for pf in pidfiles if _alive(pf)]
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
    _network_down(c)
    for sub in ("ctld", "spool", "run", "nodes"):
        p = s / sub
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


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
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
