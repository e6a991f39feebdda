"""Kill-anywhere soak: a 2-rank torchrun training job is killed with SIGKILL (its launcher's whole
process group; the ranks go through the lifeline) again and again, at random moments, inside a
checkpoint write and inside the final write, and rerun after each kill. After every kill no rank
is alive, no checkpoint was lost (the newest good step never goes back) and every checkpoint
folder verifies; the end result is bit-identical to the uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import alive, children

from distlm.config import validate_config
from distlm.model import load_model_dir, read_meta
from distlm.stages import stage_config
from distlm.train import checkpoint as ck
from distlm.train.synthetic import make_inputs

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "harness" / "soak_train.py"
MAX_STEPS = 12
KEEP_LAST = 2
KILLS = 10
ATTEMPT_BOUND_S = 120.0  # one attempt never takes this long; a hang fails the test


def _cfg() -> dict:
    cfg = validate_config(
        {
            "runtime": {"timeout_s": 60},
            "broadcast": {"bucket_mb": 0.25, "chunk_mb": 0.0625, "timeout_s": 60},
            "train": {
                "max_steps": MAX_STEPS,
                "micro_batch_size": 4,
                "warmup_steps": 2,
                "ckpt_every": 1,
                "eval_every": 4,
                "eval_batches": 2,
                "keep_last": KEEP_LAST,
                "log_every": 1,
                "profile": {"enabled": False},
            },
        }
    )
    return stage_config(cfg, "train")


class Job:
    """One attempt: torchrun + 2 ranks running the harness, in a session of its own."""

    def __init__(self, inputs: dict, cfg_path: Path, out: Path, events: Path) -> None:
        self.events = events
        self.seen = len(events.read_text().splitlines()) if events.exists() else 0
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            str(HARNESS),
            "--config",
            str(cfg_path),
            "--tokens",
            str(inputs["tokens"]),
            "--tokenizer",
            str(inputs["tokenizer"]),
            "--model",
            str(inputs["model"]),
            "--out",
            str(out),
            "--rank-log",
            str(out / "logs" / "rank{rank}.log"),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DISTLM_SOAK_EVENTS": str(events),
            "PYTHONPATH": str(ROOT / "src"),
        }
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ranks: set[int] = set()

    def new_events(self) -> list[str]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [line.split()[0] for line in lines[self.seen :]]

    def poll(self) -> int | None:
        self.ranks.update(children(self.proc.pid))
        return self.proc.poll()

    def kill(self) -> None:
        self.ranks.update(children(self.proc.pid))
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def survivors(self, bound_s: float = 10.0) -> list[int]:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline and any(alive(p) for p in self.ranks):
            time.sleep(0.1)
        return [p for p in self.ranks if alive(p)]


def _run_until(job: Job, trigger: tuple) -> bool:
    """Wait for the trigger (then kill: True) or the end of the job (False). Triggers: ("start",
    s) s seconds after the launch (imports, process group, resume); ("ckpt", n) inside the n-th
    checkpoint write of this attempt; ("after", s) s seconds after the first one (steps,
    evaluation, writes); ("final", _) inside the final write; ("none", _) never."""
    kind, arg = trigger
    first_write = None
    while time.monotonic() - job.started < ATTEMPT_BOUND_S:
        rc = job.poll()
        if rc is not None:
            assert rc == 0, job.proc.stderr.read()[-4000:]
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


def _check_checkpoints(ckpt_dir: Path, newest_before: int) -> int:
    found = ck.list_checkpoints(ckpt_dir)
    for c in found:  # a kill never leaves a folder that looks finished but is not
        ck.verify(c)
    good = ck.latest_good(ckpt_dir)
    newest = good.step if good else 0
    assert newest >= newest_before, f"checkpoint lost: newest was {newest_before}, now {newest}"
    assert len(found) <= KEEP_LAST + 1  # at most the new one before its prune
    return newest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_anywhere_soak(tmp_path):
    inputs = make_inputs(tmp_path / "inputs", train_blocks=32, val_blocks=8)
    cfg_path = tmp_path / "train.json"
    cfg_path.write_text(json.dumps(_cfg()))

    ref = Job(inputs, cfg_path, tmp_path / "ref", tmp_path / "ref-events")
    assert not _run_until(ref, ("time", ATTEMPT_BOUND_S * 2))  # uninterrupted

    rng = random.Random(14)
    out, events = tmp_path / "soak", tmp_path / "soak-events"
    kills: list[str] = []
    newest = 0
    final_killed = False
    for _attempt in range(3 * KILLS):
        left = MAX_STEPS - newest  # checkpoint writes this attempt will make
        if len(kills) >= KILLS:
            trigger = ("none", None)  # the rerun that finishes
        elif len(kills) == KILLS - 1 and not final_killed:
            trigger = ("final", None)  # trains to the end from wherever it is, dies writing
        elif left <= 1:  # the last step (or none: finished work), then the final write
            trigger = rng.choice([("start", rng.uniform(0.3, 4.0)), ("final", None)])
            if not final_killed:
                trigger = ("final", None)
        else:  # each trigger fires before the attempt could finish: every attempt is killed
            choices = [("start", rng.uniform(0.3, 4.0)), ("ckpt", rng.randint(1, min(3, left)))]
            if left >= 5:  # steps take >= the 0.3 s write window each: 1.5 s < 5 steps
                choices.append(("after", rng.uniform(0.0, 1.5)))
            trigger = rng.choice(choices)
        job = Job(inputs, cfg_path, out, events)
        if not _run_until(job, trigger):
            break
        kills.append(f"{trigger[0]}@{newest}")
        final_killed |= trigger[0] == "final"
        assert job.survivors() == [], "a rank outlived its killed launcher"
        newest = _check_checkpoints(out / "checkpoints", newest)
    print(f"soak: {len(kills)} kills (kind@newest good step before it): {', '.join(kills)}")
    assert len(kills) == KILLS and final_killed
    assert sum(k.startswith("ckpt") for k in kills) >= 2
    assert (out / "final").is_dir()

    wa = load_model_dir(tmp_path / "ref" / "final").state_dict()
    wb = load_model_dir(out / "final").state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "ref" / "final" / "model.safetensors").read_bytes() == (
        out / "final" / "model.safetensors"
    ).read_bytes()
    strip = lambda p: [",".join(r.split(",")[:6]) for r in p.read_text().splitlines()]
    assert strip(tmp_path / "ref" / "metrics.csv") == strip(out / "metrics.csv")
    assert strip(tmp_path / "ref" / "val.csv") == strip(out / "val.csv")
    assert read_meta(out / "final")["training"]["steps"] == MAX_STEPS
    leftovers = [
        p.name for d in (out, out / "checkpoints") for p in d.iterdir() if p.name.startswith(".")
    ]
    assert leftovers == [], leftovers
