"""distlm-launch (multi-node torchrun under SLURM) and the SLURM profiles, without a cluster.

The same code paths against a real cluster: tests/test_slurm.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distlm import DistlmError, launch
from distlm.launch import requeue, slurm, srun
from distlm.train.documents import STOP_NOTICE_ENV, StopNotice

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import profile as test_profile

SCONTROL_JOB = (
    "JobId=42 JobName=ab12 UserId=root(0) GroupId=root(0) JobState=RUNNING Reason=None "
    "NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=2 ReqB:S:C:T=0:0:*:* NodeList=node[1-2] "
    "BatchHost=node1 Requeue=1 Restarts=2 WorkDir=/tmp/my work dir Command=(null)"
)


class FakeRun:
    """Answers `scontrol` like a cluster with job 42 on node1,node2; records the calls."""

    def __init__(self, job_text=SCONTROL_JOB, rc=0):
        self.calls, self.job_text, self.rc = [], job_text, rc

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if cmd[1:3] == ["show", "job"]:
            return subprocess.CompletedProcess(cmd, self.rc, self.job_text, "no such job")
        return subprocess.CompletedProcess(cmd, 0, "node1\nnode2\n", "")


def test_parse_job_reads_fields_and_ignores_spaced_values():
    f = slurm.parse_job(SCONTROL_JOB)
    assert f["NodeList"] == "node[1-2]" and f["CPUs/Task"] == "2" and f["NumNodes"] == "2"
    assert f["BatchHost"] == "node1"


def test_read_allocation_expands_hostnames():
    run = FakeRun()
    alloc = slurm.read_allocation("42", run=run)
    assert alloc.hosts == ("node1", "node2") and alloc.head == "node1"
    assert alloc.cpus_per_task == 2 and alloc.restarts == 2
    assert run.calls[1] == ["scontrol", "show", "hostnames", "node[1-2]"]


def test_read_allocation_errors_name_the_command():
    with pytest.raises(DistlmError, match="scontrol show job -o 42.*no such job"):
        slurm.read_allocation("42", run=FakeRun(rc=1))
    with pytest.raises(DistlmError, match="job 42 has no NodeList"):
        slurm.read_allocation("42", run=FakeRun(job_text="JobId=42 NodeList=(null)"))


def test_srun_command_one_task_per_node_with_c10d_on_head():
    alloc = slurm.Allocation(job_id="42", hosts=("node1", "node2"), cpus_per_task=2)
    cmd = srun.srun_command(
        alloc, ["--nproc-per-node=4", "train.py", "--x", "1"], port=29400, python="py"
    )
    assert cmd[:8] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--kill-on-bad-exit=1",
        f"--wait={srun.STRAGGLER_WAIT_S}",
        "--job-name=distlm-allocation-1",
    ]
    assert cmd[8:13] == [*srun.TASK_IGNORES_WARNING, "py"]  # the warning ignored, then Python
    assert "--rdzv-endpoint=node1:29400" in cmd and "--rdzv-id=42" in cmd
    assert f"--rdzv-conf=join_timeout={srun.DEFAULT_JOIN_TIMEOUT_S}" in cmd
    assert cmd[cmd.index("--") + 1 :] == ["--nproc-per-node=4", "train.py", "--x", "1"]
    given = srun.srun_command(alloc, ["--rdzv-conf=join_timeout=5", "t.py"], port=1, python="py")
    assert not any(a.startswith("--rdzv-conf=join_timeout=300") for a in given)
    script_arg = srun.srun_command(alloc, ["t.py", "--rdzv-conf=x"], port=1, python="py")
    assert f"--rdzv-conf=join_timeout={srun.DEFAULT_JOIN_TIMEOUT_S}" in script_arg


def test_each_srun_task_starts_with_the_warning_ignored(tmp_path):
    """The launcher sends SIGUSR1 again every few seconds; one that reached an srun task while
    its Python was still importing distlm.launch (where it used to set SIG_IGN) killed the task
    (the default action) and --kill-on-bad-exit the step, without a checkpoint. The task srun
    runs ignores it before it execs Python, from the dispositions slurmstepd gives it, and keeps
    it ignored through to torchrun."""
    import signal

    probe = tmp_path / "python"  # stands for Python: shows what it is started with, then runs
    probe.write_text("#!/bin/sh\ngrep '^SigIgn:' /proc/$$/status\nsleep 1\n")
    probe.chmod(0o755)
    alloc = slurm.Allocation(job_id="42", hosts=("node1", "node2"), cpus_per_task=2)
    cmd = srun.srun_command(alloc, ["t.py"], port=1, python=str(probe))
    task = cmd[next(i for i, a in enumerate(cmd[1:], 1) if not a.startswith("-")) :]  # srun's
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # as slurmstepd starts a task
    try:
        proc = subprocess.Popen(task, stdout=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGUSR1, before)
    try:
        ignored = int(proc.stdout.readline().split()[1], 16)
        for _ in range(5):  # the warning and its repeats, while the task runs
            os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert ignored & (1 << (signal.SIGUSR1 - 1))


def test_node_command_takes_nodes_from_srun_task_env():
    argv = ["--rdzv-endpoint=node1:1", "--rdzv-id=42", "--", "--nproc-per-node=2", "t.py"]
    env = {"SLURM_NNODES": "3", "SLURM_NODEID": "1", "SLURMD_NODENAME": "node2"}
    cmd = srun.node_command(argv, env, python="py")
    assert cmd == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node1:1",
        "--rdzv-id=42",
        "--rdzv-conf=is_host=false",
        "--nproc-per-node=2",
        "t.py",
    ]
    with pytest.raises(DistlmError, match="SLURM_NNODES not set"):
        srun.node_command(argv, {}, python="py")


def test_only_the_rendezvous_head_hosts_the_store():
    """is_host is told, never guessed: a head that cannot bind its port fails instead of joining
    whatever listens there as a client (torchrun's fallback)."""
    own = ["--rdzv-endpoint=node1:29400", "--rdzv-id=7", "--rdzv-conf=join_timeout=300", "--"]

    def conf(argv, node):
        cmd = srun.node_command(argv, {"SLURM_NNODES": "2", "SLURMD_NODENAME": node}, python="p")
        cmd = cmd[: cmd.index("t.py")]  # torchrun's options, not the script's
        return [a for a in cmd if "rdzv-conf" in a or "is_host" in a]

    user = ["--nproc-per-node=1", "t.py", "--rdzv-conf", "is_host=true"]  # the script's own args
    assert conf([*own, *user], "node1") == ["--rdzv-conf=join_timeout=300,is_host=true"]
    assert conf([*own, *user], "node2") == ["--rdzv-conf=join_timeout=300,is_host=false"]
    # the caller's --rdzv-conf (then the launcher adds no join_timeout of its own)
    given = ["--rdzv-endpoint=node1:1", "--", "--rdzv-conf", "read_timeout=9", "t.py"]
    assert conf(given, "node2") == ["--rdzv-conf", "read_timeout=9,is_host=false"]
    with pytest.raises(DistlmError, match="sets is_host, which the launcher decides"):
        srun.node_command(
            ["--rdzv-endpoint=node1:1", "--", "--rdzv-conf=is_host=1", "t.py"],
            {"SLURM_NNODES": "2", "SLURMD_NODENAME": "node2"},
        )
    with pytest.raises(DistlmError, match="--rdzv-conf needs a value"):
        srun.node_command(["--rdzv-endpoint=node1:1", "--", "--rdzv-conf"], {"SLURM_NNODES": "2"})


def test_spread_procs_divides_the_total_over_nodes():
    assert [srun.spread(3, 2, i) for i in range(2)] == [2, 1]
    assert [srun.spread(8, 4, i) for i in range(4)] == [2, 2, 2, 2]
    with pytest.raises(DistlmError, match="3 processes cannot cover 4 nodes"):
        srun.spread(3, 4, 0)
    argv = ["--spread-procs", "--rdzv-id=1", "--", "--nproc-per-node", "3", "t.py", "--n", "9"]
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    cmd = srun.node_command(argv, env, python="py")
    assert cmd[3:] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-id=1",
        "--nproc-per-node=1",
        "t.py",
        "--n",
        "9",
    ]
    alloc = slurm.Allocation(job_id="7", hosts=("a", "b", "c"), cpus_per_task=1)
    assert "--spread-procs" in srun.srun_command(
        alloc, ["--nproc-per-node=3", "t.py"], port=1, spread_procs=True
    )
    with pytest.raises(DistlmError, match="2 processes cannot cover 3 nodes"):
        srun.srun_command(alloc, ["--nproc-per-node=2", "t.py"], port=1, spread_procs=True)
    with pytest.raises(DistlmError, match="no --nproc-per-node"):
        srun.srun_command(alloc, ["t.py"], port=1, spread_procs=True)


def test_node_env_gives_each_rank_its_share_of_the_task_cpus():
    cmd = ["py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "t.py"]
    quiet = {"LOGLEVEL": "WARNING"}  # the caller's choice of torchrun's agent log level stands
    assert srun.node_env(cmd, {"SLURM_CPUS_PER_TASK": "8", **quiet}) == {"OMP_NUM_THREADS": "4"}
    assert srun.node_env(cmd, {"SLURM_CPUS_PER_TASK": "1", **quiet}) == {"OMP_NUM_THREADS": "1"}
    assert srun.node_env(cmd, {"SLURM_CPUS_PER_TASK": "8", "OMP_NUM_THREADS": "3", **quiet}) == {}
    assert srun.node_env(cmd, {}) == {"LOGLEVEL": "INFO"}


@pytest.mark.parametrize(
    "arg", ["--standalone", "--nnodes=2", "--rdzv-endpoint=x:1", "--master-port=5"]
)
def test_launcher_owned_torchrun_options_are_refused(arg):
    with pytest.raises(DistlmError, match=f"torchrun option {arg.split('=')[0]} is set by"):
        srun.check_torchrun_args([arg, "--nproc-per-node=2", "t.py"])


def test_script_args_after_the_script_are_not_checked():
    srun.check_torchrun_args(["--nproc-per-node=2", "t.py", "--nnodes=7"])
    with pytest.raises(DistlmError, match="no script.py given"):
        srun.check_torchrun_args(["--nproc-per-node=2"])


def test_rendezvous_port_free_on_head_and_from_job_id_elsewhere():
    alloc = slurm.Allocation(job_id="42", hosts=("node1", "node2"), cpus_per_task=1)
    assert srun.rendezvous_port(alloc, "node2") == (20042, None)
    port, holder = srun.rendezvous_port(alloc, "node1")
    with holder:  # held: a plain bind cannot take it, the store's (SO_REUSEADDR) listen can
        assert holder.getsockname()[1] == port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("", port))
        with socket.socket() as store:
            store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            store.bind(("", port))
            store.listen()


def test_cli_outside_slurm_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    assert launch.main(["srun-torchrun", "--nproc-per-node=2", "t.py"]) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err
    assert launch.main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err


def _profile():
    return yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())


def test_slurm_profile_multi_process_rules_carry_mpi_and_launchers():
    prof = _profile()
    assert prof["executor"] == "slurm"
    assert not any(e.startswith("mpi=") for e in prof["default-resources"]), (
        "mpi in default-resources would take every job out of its srun wrapper"
    )
    rules = prof["set-resources"]
    for rule in ("broadcast", "train", "evaluate"):
        assert rules[rule]["torchrun"].startswith("'distlm-launch srun-torchrun"), rule
        assert "mpi" in rules[rule], f"{rule} calls srun itself: it needs the mpi resource"
        assert rules[rule]["tasks"] == rules[rule]["nodes"] >= 2, rule
    assert rules["inference"]["mpi"] == "'srun --mpi=pmi2'"


def test_pyproject_pins_the_slurm_plugins():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"snakemake-executor-plugin-slurm-jobstep>=0.6.1' in text
    assert '"snakemake-executor-plugin-slurm==' in text, "profiles/slurm is written for one version"


def test_test_profile_layers_overrides_on_the_real_profile(tmp_path):
    out = yaml.safe_load((test_profile.write_test_profile(tmp_path) / "config.yaml").read_text())
    base = _profile()
    assert out["executor"] == "slurm"
    assert out["slurm-init-seconds-before-status-checks"] < 10
    assert "slurm_partition='debug'" in out["default-resources"]
    assert "slurm_partition=''" not in out["default-resources"]
    # per-rule keys the overrides do not name come from the real profile unchanged
    assert out["set-resources"]["train"]["torchrun"] == base["set-resources"]["train"]["torchrun"]
    assert out["set-resources"]["train"]["mem_mb"] != base["set-resources"]["train"]["mem_mb"]


def test_harness_says_why_it_cannot_run(monkeypatch):
    from harness import slurm_cluster as sc

    monkeypatch.setattr(sc.os, "geteuid", lambda: 1000)
    assert "needs root" in sc.missing_requirements()
    monkeypatch.setattr(sc.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sc.shutil, "which", lambda name: None)
    monkeypatch.setattr(sc, "_sbin", lambda name: f"/nonexistent/{name}")
    monkeypatch.setattr(sc, "Path", lambda *a: Path("/nonexistent", *a[1:]))
    why = sc.missing_requirements()
    assert "slurmctld" in why and "sbatch" in why and ".ci/slurm-setup" in why


def test_harness_slurm_conf_has_one_line_per_node_and_no_accounting():
    from harness import slurm_cluster as sc

    c = sc.Cluster(state=Path("/s"), nodes=3, subnet="10.9.0")
    conf = sc.slurm_conf(c)
    assert "NodeName=node3 NodeAddr=10.9.0.13 NodeHostname=node3" in conf
    assert "AccountingStorageType=accounting_storage/none" in conf and "MinJobAge=3600" in conf
    assert "SlurmctldHost=ctl(10.9.0.1)" in conf
    assert sc.hosts_file(c).splitlines()[-1] == "10.9.0.13 node3"


def test_a_session_cluster_shares_no_state_name_or_subnet(tmp_path, monkeypatch):
    """Two test sessions at once (or one beside the CLI's default cluster) never share a daemon's
    state, a bridge or namespace name, or an address."""
    from harness import slurm_cluster as sc

    shown = "2: eth0    inet 10.77.0.1/24 brd\n3: x    inet 10.77.12.1/24 brd\n"
    monkeypatch.setattr(
        sc, "_run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=shown)
    )
    monkeypatch.setattr(sc.os, "getpid", lambda: 4194242)
    c = sc.session_cluster(tmp_path / "state")
    assert c.state == tmp_path / "state" and c.name == "dl4194242"
    assert len(c.bridge) <= 15 and len(c.veth(8)) <= 15  # Linux's interface name limit
    assert c.subnet == "10.77.13"  # 10 + 4194242 % 240 = 12 is in use (0 and 9: others')
    monkeypatch.delenv("DISTLM_SLURM_STATE", raising=False)
    monkeypatch.delenv("DISTLM_SLURM_NAME", raising=False)
    monkeypatch.delenv("DISTLM_SLURM_SUBNET", raising=False)
    default = sc.default_cluster(2)
    assert c.state != default.state and c.name != default.name and c.subnet != default.subnet


def test_launcher_options_and_the_time_limit_warning(monkeypatch):
    opts = launch.LauncherOptions
    assert launch._launcher_options(["--signal-before=120", "--spread-procs", "t.py"]) == (
        opts(spread_procs=True, signal_before=120.0),
        ["t.py"],
    )
    assert launch._launcher_options(["--signal-before", "30", "--nproc-per-node=2", "t.py"]) == (
        opts(signal_before=30.0),
        ["--nproc-per-node=2", "t.py"],
    )
    assert launch._launcher_options(
        ["--signal-before=30", "--max-requeues", "4", "-m", "distlm.x", "--max-requeues=9"]
    ) == (opts(signal_before=30.0, max_requeues=4), ["-m", "distlm.x", "--max-requeues=9"])
    with pytest.raises(DistlmError, match="--signal-before needs a positive number"):
        launch._launcher_options(["--signal-before=soon", "t.py"])
    with pytest.raises(DistlmError, match="--max-requeues needs a whole number >= 0, got '-1'"):
        launch._launcher_options(["--signal-before=9", "--max-requeues=-1", "t.py"])
    with pytest.raises(DistlmError, match="--max-requeues needs --signal-before"):
        launch._launcher_options(["--max-requeues=3", "t.py"])
    assert slurm.parse_end_time("Unknown") is None
    end = slurm.parse_end_time("2026-11-22T19:30:00")
    assert end is not None and time.localtime(end).tm_hour == 19
    # 0.5 s before a limit 1 s away: scancel --signal=USR1 for the job after ~0.5 s, then again
    # every RESEND_S (a step or rank that starts late gets it too) until the launcher stops it
    monkeypatch.setattr(slurm, "RESEND_S", 0.2)
    calls = []
    monkeypatch.setattr(slurm, "scontrol", lambda *a, **k: "JobId=9 EndTime=Unknown")
    monkeypatch.setattr(
        slurm.subprocess,
        "run",
        lambda cmd, **k: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0),
    )
    alloc = slurm.Allocation(job_id="9", hosts=("a",), cpus_per_task=1, end_time=time.time() + 1)
    warning = slurm.LimitWarning(alloc, 0.5)
    t0 = time.monotonic()
    warning.start()
    while len(calls) < 3:
        assert time.monotonic() - t0 < 10, calls
        time.sleep(0.01)
    assert time.monotonic() - t0 >= 0.4 + 2 * 0.2 and warning.sent.is_set()
    warning.stop()
    warning._thread.join(timeout=5)
    assert not warning._thread.is_alive()
    assert set(map(tuple, calls)) == {("scancel", "--signal=USR1", "9")}


def _notice(*signals: str, step: int = 700) -> StopNotice:
    return StopNotice(
        step=step, max_steps=4000, signals=list(signals), checkpoint_run="r", slurm_job="9"
    )


def test_only_a_time_limit_stop_at_a_checkpoint_is_requeued_within_the_bound():
    alloc = slurm.Allocation(job_id="9", hosts=("a",), cpus_per_task=1, restarts=1)
    opts = launch.LauncherOptions(signal_before=30.0, max_requeues=3)

    usr1 = _notice("SIGUSR1")

    def decide(rc=1, warned=True, notice=usr1, alloc=alloc, opts=opts):
        return requeue.requeue_decision(
            alloc, opts.max_requeues, rc=rc, warned=warned, notice=notice
        )

    yes, why = decide()
    assert yes and "requeueing job 9 (requeue 2 of at most 3)" in why and "step 700" in why
    assert decide(rc=0) == (False, "training finished")
    # an error, a NaN, a bad config: no notice, whatever the exit code
    no, why = decide(notice=None)
    assert not no and "without a stop notice" in why
    # scancel or preemption (SIGTERM), or a SIGUSR1 this launcher did not send
    assert not decide(notice=_notice("SIGTERM"))[0]
    assert not decide(notice=_notice("SIGUSR1", "SIGTERM"), warned=False)[0]
    # the bound, and requeueing off
    last = slurm.Allocation(job_id="9", hosts=("a",), cpus_per_task=1, restarts=3)
    no, why = decide(alloc=last)
    assert not no and "after 3 requeues of job 9: --max-requeues=3 reached" in why
    assert not decide(opts=launch.LauncherOptions(signal_before=30.0))[0]


def test_the_stop_notice_is_read_once_and_refused_when_malformed(tmp_path, monkeypatch):
    from distlm.core.documents import DocumentError
    from distlm.train.stopping import write_stop_notice

    alloc = slurm.Allocation(job_id="9", hosts=("a",), cpus_per_task=1, restarts=2)
    path = requeue.notice_path(alloc, tmp_path)
    assert path == tmp_path / ".distlm-launch-job-9-allocation-3.stop.json"
    assert requeue.read_notice(path) is None
    assert write_stop_notice(_notice("SIGUSR1"), {}) is None  # no launcher asked
    assert write_stop_notice(_notice("SIGUSR1"), {STOP_NOTICE_ENV: str(path)}) == path
    assert requeue.read_notice(path) == _notice("SIGUSR1") and not path.exists()
    assert list(tmp_path.iterdir()) == []
    path.write_text("{}")
    with pytest.raises(DocumentError, match="stop.json: no format tag"):
        requeue.read_notice(path)


def test_module_mode_passes_through_to_every_node():
    """The rules start their stage as a module (`torchrun ... -m distlm.entry.train`): the
    launcher checks torchrun's options before `-m` and hands the module and its args on."""
    alloc = slurm.Allocation(job_id="42", hosts=("node1", "node2"), cpus_per_task=2)
    args = ["--nproc-per-node=2", "--max-restarts=0", "-m", "distlm.entry.train", "--config", "c"]
    srun.check_torchrun_args(args)
    cmd = srun.srun_command(alloc, args, port=1, python="py")
    assert cmd[cmd.index("--") + 1 :] == args
    node = srun.node_command(
        cmd[cmd.index("torchrun-node") + 1 :],
        {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURMD_NODENAME": "node2"},
        python="py",
    )
    assert node[-len(args) :] == args and node[:3] == ["py", "-m", "torch.distributed.run"]
    with pytest.raises(DistlmError, match="--nnodes"):
        srun.check_torchrun_args(["--nnodes=2", "-m", "distlm.entry.train"])
