"""distlm.runtime.lifeline: a rank dies within seconds of its launcher, through the parent-death signal and
through the watchdog alone; the launchers of a torchrun training job and of an mpiexec job are
SIGKILLed mid-run and no rank is alive 10 s later (a bound, polled)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.synthetic import make_inputs
from procs import alive, children

from distlm.launch.torchrun import local_torchrun, stage_args, train_args

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 10.0


def _survivors(pids: list[int], bound_s: float = BOUND_S) -> list[int]:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}
    for k in ("TORCHELASTIC_RUN_ID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        env.pop(k, None)
    return env


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A launcher that starts one child in a session of its own (as torchrun does), prints its pid and
# waits; the child binds itself to the launcher (argv: "parent" or the pid of another process).
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                         stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(300)
"""
CHILD = """
import json, os, sys, time
from distlm.runtime.lifeline import bind_to_launcher
target = None if sys.argv[1] == "parent" else int(sys.argv[1])
ll = bind_to_launcher(target, poll_s=0.2, force=True)
print(json.dumps({"pid": os.getpid(), "pdeathsig": ll.pdeathsig, "launcher": ll.launcher_pid}),
      flush=True)
time.sleep(300)
"""


def _start(target: str) -> tuple[subprocess.Popen, dict]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD, target],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    info = json.loads(launcher.stdout.readline())
    return launcher, info


def test_a_child_dies_with_its_parent():
    launcher, info = _start("parent")
    try:
        assert info["pdeathsig"] and info["launcher"] == launcher.pid
        assert alive(info["pid"])
        os.killpg(launcher.pid, signal.SIGKILL)  # the child has a session of its own
        launcher.wait(timeout=30)
        assert _survivors([info["pid"]]) == []
    finally:
        _kill_all([launcher.pid, info["pid"]])


def test_the_watchdog_alone_ends_a_child_bound_to_another_process():
    """No parent-death signal here (the launcher is not the parent): the watchdog's work."""
    other = subprocess.Popen(["sleep", "300"])
    launcher, info = _start(str(other.pid))
    try:
        assert not info["pdeathsig"] and info["launcher"] == other.pid
        time.sleep(0.5)
        assert alive(info["pid"])  # the bound process lives: the child stays
        other.kill()
        other.wait(timeout=30)
        assert _survivors([info["pid"]]) == []
        assert launcher.poll() is None  # its real parent was never touched
    finally:
        _kill_all([launcher.pid, info["pid"], other.pid])


def test_a_plain_process_is_not_bound():
    code = "from distlm.runtime.lifeline import bind_to_launcher; print(bind_to_launcher())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "None"


def _wait_for(pred, what: str, bound_s: float = 180.0) -> None:
    deadline = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {bound_s} s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_torchrun_ranks_die_when_the_launcher_group_is_killed(tmp_path):
    from distlm.dag.config import validate_config
    from distlm.dag.stages import stage_config
    from distlm.settings.stage_configs import write_stage_config

    inputs = make_inputs(tmp_path / "inputs")
    cfg = validate_config(
        {
            "runtime": {"timeout_s": 60},
            "transfer": {"bucket_mb": 0.25, "chunk_mb": 0.0625, "timeout_s": 60},
            "train": {
                "max_steps": 100000,
                "micro_batch_size": 4,
                "warmup_steps": 2,
                "ckpt_every": 100000,
                "eval_every": 100000,
                "log_every": 1,
                "profile": {"enabled": False},
            },
        }
    )
    write_stage_config("train", stage_config(cfg, "train"), tmp_path / "train.json")
    out = tmp_path / "train"
    cmd = local_torchrun(
        stage_args(
            "train",
            nproc=2,
            max_restarts=None,
            launcher=["--monitor-interval=0.2"],
            args=train_args(
                config=tmp_path / "train.json",
                tokens=inputs["tokens"],
                tokenizer=inputs["tokenizer"],
                model=inputs["model"],
                out=out,
                rank_log=out / "logs" / "rank{rank}.log",
            ),
        )
    )
    launcher = subprocess.Popen(
        cmd,
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks: list[int] = []
    try:
        log0 = out / "logs" / "rank0.log"
        _wait_for(
            lambda: log0.is_file() and "step 2/100000" in log0.read_text(),
            "the second training step",
        )
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun's agent; its ranks have own sessions
        launcher.wait(timeout=30)
        assert _survivors(ranks) == []
    finally:
        _kill_all([launcher.pid, *ranks])


@pytest.mark.slow
def test_mpi_ranks_die_when_mpiexec_and_its_proxy_are_killed(tmp_path):
    """hydra's proxy ends its ranks when mpiexec goes; when the proxy dies too (a node agent
    killed), only the lifeline ends them."""
    launcher = subprocess.Popen(
        [
            "mpiexec",
            "-n",
            "2",
            sys.executable,
            str(ROOT / "tests" / "harness" / "lifeline_rank.py"),
        ],
        env=_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    ranks: list[int] = []
    try:
        for line in launcher.stdout:
            if line.startswith("rank ") and " pid " in line:
                ranks.append(int(line.split()[-1]))
            if len(ranks) == 2:
                break
        assert len(ranks) == 2, f"mpiexec ended (rc {launcher.poll()}) before both ranks were up"
        proxies = [p for p in children(launcher.pid) if p not in ranks]
        assert proxies and all(set(children(p)) <= set(ranks) for p in proxies)
        _kill_all(proxies)  # first, as when a node's agent dies (in sessions of their own)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert _survivors(ranks) == []
    finally:
        _kill_all([launcher.pid, *ranks])
