"""What the SLURM training tests (tests/test_slurm_durable.py, tests/test_slurm_requeue.py) share:
the target, the paced environment, the long-training overlay, the test profile with rule train's
resources changed, and a work dir copied from the session's built one (tests/conftest.py:
slurm_built)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml
from conftest import SLURM_CONFIG, TINY
from harness.faults import paced_env

TARGET = "results/train/final"
# Each training step takes at least STEP_S seconds (tests/harness/faults.py: paced_env): at most
# 10 steps a second whatever the machine, so an allocation's 15-25 s of training holds at most
# ~250 steps, and the ranks, idle most of the time, leave the CPU to the tests beside them.
STEP_S = 0.1


def cluster_env(cluster) -> dict[str, str]:
    """This environment with the cluster's client settings: training at full speed."""
    return {**os.environ, **cluster.env()}


def slurm_env(cluster) -> dict[str, str]:
    """The environment of a command of the SLURM training tests: the cluster's client settings,
    training paced at STEP_S."""
    return paced_env(cluster_env(cluster), STEP_S)


def long_training(steps: int) -> dict:
    """A config overlay: `steps` training steps, a checkpoint every 1000, one eval at the end, the
    profiler off."""
    return {
        "train": {
            "max_steps": steps,
            "ckpt_every": 1000,
            "eval_every": steps,
            "log_every": 50,
            "profile": {"enabled": False},
        }
    }


def profile_with(profile: Path, dest: Path, **train: object) -> Path:
    """The test profile with rule train's resources changed (a CLI --set-resources would replace
    the rule's whole entry, its `mpi` and `nodes` included)."""
    cfg = yaml.safe_load((profile / "config.yaml").read_text())
    cfg["set-resources"]["train"].update(train)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def prepared(built: Path, wd: Path, overlay_cfg: dict) -> tuple[Path, tuple[Path, ...]]:
    """A copy of the built work dir (data and base model, no training) at `wd`, and the config
    files of its training: tiny.yaml, the SLURM layout, `overlay_cfg` (written beside `wd`)."""
    shutil.copytree(built, wd, symlinks=True)
    overlay = wd.parent / f"{wd.name}.yaml"
    overlay.write_text(yaml.safe_dump(overlay_cfg))
    return wd, (TINY, SLURM_CONFIG, overlay)
