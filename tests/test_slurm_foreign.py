"""The SLURM harness beside the machine's own SLURM: with a munged, slurmctld and slurmd of a
system-style configuration running (Debian's defaults: /etc/slurm/slurm.conf, ports 6817/6818,
munged on /run/munge/munge.socket.2 with /etc/munge/munge.key, pid files in /run), a harness
cluster starts on its own ports, munge socket and state, runs a job across its two nodes, and
stops without touching the machine's daemons; a start that fails stops everything it started.

When the machine already runs its own SLURM (slurmctld on 6817 and munged on the default
socket), that one is the foreign cluster and is left as it is. Otherwise the test starts a
system-style one and stops exactly those daemons (by their pids) at the end, and removes the files
it created. A partial set-up of someone else (a slurm.conf, a munge socket or a port in use, with
no cluster answering) is not touched: the test skips and says so.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests"))
from harness import slurm_cluster as sc

pytestmark = pytest.mark.slurm

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
SYSTEM_KEY = Path("/etc/munge/munge.key")
SYSTEM_SOCKET = Path("/run/munge/munge.socket.2")
SYSTEM_PORTS = {"SlurmctldPort": 6817, "SlurmdPort": 6818}
SYSTEM_PIDS = {
    "munged": Path("/run/munge/munged.pid"),
    "slurmctld": Path("/run/slurmctld.pid"),
    "slurmd": Path("/run/slurmd.pid"),
}


@dataclasses.dataclass
class Foreign:
    host: str
    started: dict[str, int]  # daemon -> pid, of those this test started (none: the machine's own)

    def env(self) -> dict[str, str]:
        """A shell of the machine's own cluster: no SLURM_CONF, so /etc/slurm/slurm.conf."""
        return {k: v for k, v in os.environ.items() if not sc.CLIENT_ENV.match(k)}

    def run(self, *cmd: str, timeout: float = 60) -> str:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env(), timeout=timeout, check=False
        )
        assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}: {proc.stderr}"
        return proc.stdout


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _munge_answers(sock: Path) -> bool:
    return (
        sock.exists()
        and subprocess.run(
            ["munge", "-n", f"--socket={sock}"], capture_output=True, timeout=10, check=False
        ).returncode
        == 0
    )


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _is(pid: int, daemon: str) -> bool:
    """pid runs `daemon` (Debian's /usr/sbin/slurmctld is a link to slurmctld-wlm)."""
    return _exe(pid) == os.path.realpath(f"/usr/sbin/{daemon}")


def _pid_of(daemon: str, timeout: float = 20) -> int:
    """The pid the daemon wrote to its default pid file, once that process is the daemon."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(SYSTEM_PIDS[daemon].read_text().strip())
            if _is(pid, daemon):
                return pid
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{daemon} wrote no pid to {SYSTEM_PIDS[daemon]} in {timeout:.0f} s")


def _stop(started: dict[str, int]) -> None:
    """SIGTERM, then SIGKILL after 15 s, to exactly the pids this test started."""
    for daemon, pid in started.items():
        if _is(pid, daemon):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    alive = dict(started)
    while alive and time.monotonic() < deadline:
        alive = {d: p for d, p in alive.items() if not sc._gone(p)}
        time.sleep(0.2)
    for daemon, pid in alive.items():
        if _is(pid, daemon):
            os.kill(pid, signal.SIGKILL)


def _system_style_conf(host: str, state: Path) -> str:
    # Debian's /usr/share/doc/slurmctld/examples/slurm.conf.simple, for this host; state and logs
    # in a scratch folder, the rest (ports, pid files, munge socket) the defaults.
    return "\n".join(
        [
            "# Written by tests/test_slurm_foreign.py (removed when it ends): a system-style cluster",
            "ClusterName=foreign",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=slurm",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "ReturnToService=2",
            f"SlurmctldPidFile={SYSTEM_PIDS['slurmctld']}",
            f"SlurmdPidFile={SYSTEM_PIDS['slurmd']}",
            f"StateSaveLocation={state}/slurmctld",
            f"SlurmdSpoolDir={state}/slurmd",
            f"SlurmctldLogFile={state}/slurmctld.log",
            f"SlurmdLogFile={state}/slurmd.log",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=1 RealMemory=500",
            f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@pytest.fixture(scope="module")
def foreign():
    why = sc.missing_requirements()
    if why:
        pytest.skip(why)
    host = socket.gethostname().split(".")[0]
    if _listening(SYSTEM_PORTS["SlurmctldPort"]) and _munge_answers(SYSTEM_SOCKET):
        yield Foreign(host=host, started={})  # the machine's own cluster: used, left running
        return
    present = [str(p) for p in (SYSTEM_CONF, SYSTEM_SOCKET) if p.exists()]
    present += [f"port {p}" for p in SYSTEM_PORTS.values() if _listening(p)]
    if present:
        pytest.skip(
            f"a partial SLURM/munge set-up of this machine ({', '.join(present)}) is left alone"
        )
    if not SYSTEM_KEY.exists():
        pytest.skip(f"no {SYSTEM_KEY} (munge's package creates it)")
    # not under pytest's folder (root's, mode 700): slurmctld runs as user slurm
    state = Path(tempfile.mkdtemp(prefix="distlm-foreign-slurm-"))
    for sub in ("slurmctld", "slurmd"):
        (state / sub).mkdir()
    os.chown(state, *_ids("slurm"))
    os.chown(state / "slurmctld", *_ids("slurm"))
    created: list[Path] = []  # removed at the end, deepest first
    started: dict[str, int] = {}
    try:
        run_dir = SYSTEM_SOCKET.parent
        if not run_dir.exists():
            run_dir.mkdir(mode=0o755)
            created.append(run_dir)
            os.chown(run_dir, *_ids("munge"))
        for default in (Path("/var/lib/munge/munged.seed"), Path("/var/log/munge/munged.log")):
            if not default.exists():
                created.append(default)
        SYSTEM_CONF.write_text(_system_style_conf(host, state))
        created.append(SYSTEM_CONF)
        env = {k: v for k, v in os.environ.items() if not sc.CLIENT_ENV.match(k)}
        # as Debian's services start them: munged as user munge (it forks), slurmctld and slurmd
        # as root (slurmctld switches to SlurmUser), each daemonizing, with default paths
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], env=env, check=True)
        started["munged"] = _pid_of("munged")
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([f"/usr/sbin/{daemon}"], env=env, check=True, timeout=30)
            started[daemon] = _pid_of(daemon)
        f = Foreign(host=host, started=started)
        deadline = time.monotonic() + 30
        while f.run("sinfo", "-h", "-o", "%t").strip() != "idle":
            assert time.monotonic() < deadline, f.run("sinfo", "-N", "-l")
            time.sleep(0.5)
        yield f
    finally:
        _stop(started)
        for daemon in started:
            SYSTEM_PIDS[daemon].unlink(missing_ok=True)
        for path in reversed(created):
            if path.is_dir():
                for leftover in path.iterdir():  # munged's socket and lock file
                    leftover.unlink()
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)


def _ids(user: str) -> tuple[int, int]:
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def _processes_naming(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (the harness's daemons name its state)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def _harness(tmp_path: Path) -> sc.Cluster:
    # beside the default harness cluster (distlm-*, 10.77.0), which may be up for test_slurm.py
    return sc.Cluster(state=tmp_path / "harness", nodes=2, subnet="10.77.9", name="dlmforeign")


def _foreign_alive(foreign: Foreign) -> None:
    assert "UP" in foreign.run("scontrol", "ping")
    if foreign.started:  # ours: its one node runs a step; the machine's own may be busy
        for daemon, pid in foreign.started.items():
            assert _is(pid, daemon), f"the foreign {daemon} ({pid}) is gone"
        assert foreign.run("srun", "-N1", "hostname").strip() == foreign.host


def test_harness_runs_a_job_beside_a_system_slurm_and_munge(foreign, tmp_path, monkeypatch):
    # a shell of the machine's cluster: its SLURM_CONF and job variables must not steer the harness
    monkeypatch.setenv("SLURM_CONF", str(SYSTEM_CONF))
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.setenv("SBATCH_PARTITION", "main")
    c = _harness(tmp_path)
    try:
        sc.up(c)
        assert not set(c.ports().values()) & set(SYSTEM_PORTS.values()), c.ports()
        assert f"AuthInfo=socket={c.munge_socket}" in c.conf.read_text()
        out = tmp_path / "job.out"
        job = subprocess.run(
            ["sbatch", "-W", "-N2", "-n2", f"--output={out}", "--wrap=srun -l hostname"],
            capture_output=True,
            text=True,
            env=c.env(),
            timeout=120,
            check=False,
        )
        assert job.returncode == 0, job.stderr + (out.read_text() if out.exists() else "")
        assert sorted(line.split(": ")[1] for line in out.read_text().split("\n") if line) == [
            "node1",
            "node2",
        ]
        job_id = job.stdout.split()[-1]
        # the job is the harness's: the machine's controller does not know it
        assert job_id not in foreign.run("squeue", "-h", "-o", "%i")
        _foreign_alive(foreign)
    finally:
        sc.down(c)
    assert not _processes_naming(c.state), _processes_naming(c.state)
    _foreign_alive(foreign)


def test_a_failed_start_stops_what_it_started_and_names_the_step(foreign, tmp_path, monkeypatch):
    # the controller is given the machine's slurmctld port: the clash the harness used to hit
    taken = SYSTEM_PORTS["SlurmctldPort"]
    free = sc._free_ports(1, avoid={taken})[0]
    monkeypatch.setattr(sc, "_free_ports", lambda n, avoid=frozenset(): [taken, free])
    c = _harness(tmp_path)
    started = time.monotonic()
    with pytest.raises(sc.HarnessError) as err:
        sc.up(c)
    msg = str(err.value)
    assert "start failed at step slurmctld: slurmctld exited" in msg, msg
    assert "Address already in use" in msg and "slurmctld.log" in msg, msg  # the daemon's log tail
    assert "everything it had started is stopped" in msg, msg
    assert time.monotonic() - started < 25, "the dead slurmctld was not noticed at once"
    assert not _processes_naming(c.state), _processes_naming(c.state)  # munged included
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert c.netns(1) not in netns.stdout
    _foreign_alive(foreign)
