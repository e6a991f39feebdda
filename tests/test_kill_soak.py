"""Kill-anywhere soak through the user's command: `snakemake --profile profiles/local
results/train/final` is killed with SIGKILL to its whole process group (what Ctrl-C twice, a lost
ssh session or an OOM kill of the login shell does: Snakemake, the job's shell, torchrun and the
ranks) again and again, at random moments: during start-up, training steps, inside a checkpoint
write and inside the final write. After each kill the user's commands follow: `--unlock`, then the
same command. After every kill no process of the job is alive 10 s later, no checkpoint was lost
(the newest good step never goes back) and every checkpoint folder verifies; the end result is
byte-identical to an uninterrupted run of the same command.

The windows inside the writes come from tests/harness/soak_hooks/sitecustomize.py (on PYTHONPATH
for the soak only): nothing in the library knows about the test."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY, copy_workflow, snakemake_cmd
from procs import alive, children

from distlm.model import load_model_dir, read_meta
from distlm.train import checkpoint as ck
from distlm.train import identity as ident

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "tests" / "harness" / "soak_hooks"
TARGET = "results/train/final"
MAX_STEPS = 12
KEEP_LAST = 2
KILLS = 10
ATTEMPT_BOUND_S = 180.0  # one attempt never takes this long; a hang fails the test
SOAK = {
    "train": {
        "max_steps": MAX_STEPS,
        "ckpt_every": 1,
        "eval_every": 4,
        "keep_last": KEEP_LAST,
        "log_every": 1,
        "profile": {"enabled": False},
    }
}


def _cmd(work: Path, soak_cfg: Path, *args: str) -> list[str]:
    return snakemake_cmd(work, *args, configfiles=(TINY, soak_cfg))


def _env(events: Path) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DISTLM_SOAK_EVENTS": str(events),
        "PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT / "src")]),
    }


class Attempt:
    """One run of the user's command, in a session of its own (its process group is what a
    terminal's Ctrl-C or a dead login shell takes down)."""

    def __init__(self, work: Path, soak_cfg: Path, events: Path) -> None:
        self.events = events
        self.seen = len(events.read_text().splitlines()) if events.exists() else 0
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            _cmd(work, soak_cfg, TARGET),
            env=_env(events),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.pids: set[int] = set()

    def _collect(self) -> None:
        todo = [self.proc.pid]
        while todo:  # Snakemake -> shell -> torchrun -> ranks
            kids = children(todo.pop())
            self.pids.update(kids)
            todo.extend(kids)

    def new_events(self) -> list[str]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [line.split()[0] for line in lines[self.seen :]]

    def poll(self) -> int | None:
        self._collect()
        return self.proc.poll()

    def kill(self) -> None:
        self._collect()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def survivors(self, bound_s: float = 10.0) -> list[int]:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline and any(alive(p) for p in self.pids):
            time.sleep(0.1)
        return [p for p in self.pids if alive(p)]


def _run_until(job: Attempt, trigger: tuple) -> bool:
    """Wait for the trigger (then kill: True) or the end of the command (False). Triggers:
    ("start", s) s seconds after the command (Snakemake's start-up, the job's, torchrun's, the
    ranks' resume); ("ckpt", n) inside the n-th checkpoint write of this attempt; ("after", s) s
    seconds after the first one (steps, evaluation, writes); ("final", _) inside the final write;
    ("none", _) never."""
    kind, arg = trigger
    first_write = None
    while time.monotonic() - job.started < ATTEMPT_BOUND_S:
        rc = job.poll()
        if rc is not None:
            out = job.proc.stdout.read() if job.proc.stdout else ""
            assert rc == 0, out[-6000:]
            return False
        events = job.new_events()
        if first_write is None and "ckpt-write" in events:
            first_write = time.monotonic()
        if (
            (kind == "start" and time.monotonic() - job.started >= arg)
            or (kind == "ckpt" and events.count("ckpt-write") >= arg)
            or (kind == "after" and first_write and time.monotonic() - first_write >= arg)
            or (kind == "final" and "final-write" in events)
        ):
            job.kill()
            return True
        time.sleep(0.02)
    job.kill()
    raise AssertionError(f"attempt still running after {ATTEMPT_BOUND_S} s (trigger {trigger})")


def _newest_good(work: Path, newest_before: int) -> int:
    root = work / "results" / "train" / "checkpoints"
    runs = [r for r, _ in ident.list_runs(root)]
    assert len(runs) <= 1, runs  # one run identity: every attempt is the same run
    newest = 0
    for run in runs:
        found = ck.list_checkpoints(run)
        for c in found:  # a kill never leaves a folder that looks finished but is not
            ck.verify(c)
        assert len(found) <= KEEP_LAST + 1  # at most the new one before its prune
        good = ck.latest_good(run)
        newest = good.step if good else 0
    assert newest >= newest_before, f"checkpoint lost: newest was {newest_before}, now {newest}"
    return newest


def _user(work: Path, soak_cfg: Path, events: Path, *args: str) -> None:
    proc = subprocess.run(
        _cmd(work, soak_cfg, *args), env=_env(events), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.with_requeue
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    ("parallel", "plan"),
    [
        ("ddp", None),  # KILLS random triggers
        # fsdp (every rank writes its shards of each checkpoint): a shorter plan of its own, each
        # kind of kill in it: inside a checkpoint's write (its index written, every shard on
        # disk, the folder not renamed), at start-up, between writes, inside the final write
        ("fsdp", [("ckpt", 1), ("start", 4.0), ("ckpt", 2), ("after", 1.0), ("final", None)]),
    ],
    ids=["ddp", "fsdp"],
)
def test_kill_anywhere_soak_through_snakemake(tmp_path, workflow_run, parallel, plan):
    """Kills of the user's command (`plan`'s, or KILLS at random), then the run that finishes,
    under train.parallel `parallel`."""
    kills = KILLS if plan is None else len(plan)
    soak_cfg = tmp_path / "soak.yaml"
    soak_cfg.write_text(yaml.safe_dump({"train": {**SOAK["train"], "parallel": parallel}}))
    # The stages before training come from the tiny workflow (the soak edits train.* only, so
    # its data and base model are the same): the soak is about the train job and Snakemake
    # around it. Its training starts afresh in both folders.
    ref, work = (
        copy_workflow(workflow_run, tmp_path / name, without=("results/train", "logs/train"))
        for name in ("ref", "soak")
    )
    _user(ref, soak_cfg, tmp_path / "ref-events", TARGET)  # uninterrupted

    rng = random.Random(20)
    events = tmp_path / "soak-events"
    newest = 0
    final_killed = False
    done: list[str] = []
    for _attempt in range(3 * kills):
        left = MAX_STEPS - newest  # checkpoint writes this attempt will make
        if len(done) >= kills:
            trigger = ("none", None)  # the rerun that finishes
        elif plan is not None:
            trigger = plan[len(done)]
        elif len(done) == kills - 1 and not final_killed:
            trigger = ("final", None)  # trains to the end from wherever it is, dies writing
        elif left <= 1:  # the last step (or none: finished work), then the final write
            trigger = ("final", None) if not final_killed else ("start", rng.uniform(0.5, 6.0))
        else:  # each trigger fires before the attempt could finish: every attempt is killed
            choices = [("start", rng.uniform(0.5, 6.0)), ("ckpt", rng.randint(1, min(3, left)))]
            if left >= 5:  # steps take >= the 0.3 s write window each: 1.5 s < 5 steps
                choices.append(("after", rng.uniform(0.0, 1.5)))
            trigger = rng.choice(choices)
        job = Attempt(work, soak_cfg, events)
        if not _run_until(job, trigger):
            break
        done.append(f"{trigger[0]}@{newest}")
        final_killed |= trigger[0] == "final"
        assert job.survivors() == [], "a process of the killed command outlived it"
        newest = _newest_good(work, newest)
        _user(work, soak_cfg, events, "--unlock")
    print(f"soak: {len(done)} kills (kind@newest good step before it): {', '.join(done)}")
    assert len(done) == kills and final_killed
    assert sum(k.startswith("ckpt") for k in done) >= 2
    assert sum(k.startswith("start") for k in done) >= 1

    a, b = ref / "results" / "train", work / "results" / "train"
    wa = load_model_dir(a / "final").state_dict()
    wb = load_model_dir(b / "final").state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "final" / "model.safetensors").read_bytes() == (
        b / "final" / "model.safetensors"
    ).read_bytes()
    strip = lambda p: [",".join(r.split(",")[:6]) for r in p.read_text().splitlines()]
    assert strip(a / "metrics.csv") == strip(b / "metrics.csv")
    # val.csv without its last column, each validation's wall time
    val = lambda p: [",".join(r.split(",")[:4]) for r in p.read_text().splitlines()]
    assert val(a / "val.csv") == val(b / "val.csv")
    assert read_meta(b / "final").training["steps"] == MAX_STEPS
    leftovers = [
        p.name
        for d in (b, b / "checkpoints", *[r for r, _ in ident.list_runs(b / "checkpoints")])
        for p in d.iterdir()
        if p.name.startswith(".")
    ]
    assert leftovers == [], leftovers
    assert not (b / "checkpoints" / "trainer.lease.json").exists()
