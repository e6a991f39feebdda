"""Test faults of the training stage, asked for by a test and never by the user's config.

In process, a test sets `distlm.train.faults.REQUESTED` (`inject`). For a stage started as the
user starts it (torchrun, Snakemake), `fault_env` writes the spec as JSON, names it in
DISTLM_TEST_FAULTS and puts tests/harness/fault_hooks on PYTHONPATH: that folder's
`sitecustomize` reads the spec in every training rank (RANK set) before the trainer starts.
`paced_env` sets a floor on each training step's time the same way (DISTLM_TEST_STEP_S), and
`background_checkpoints_env` has the ranks write checkpoints as on a GPU.
`slow_reader_env` puts tests/harness/slow_reader on PYTHONPATH: MPI rank 1's proxy stops reading
while the rank logs its first error (see that folder's `sitecustomize`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from distlm.train import faults

if TYPE_CHECKING:
    import pytest

ENV = "DISTLM_TEST_FAULTS"
STEP_ENV = "DISTLM_TEST_STEP_S"
HOOKS = Path(__file__).resolve().parent / "fault_hooks"
SLOW_READER = Path(__file__).resolve().parent / "slow_reader"


def _on_path(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with `folder` first on PYTHONPATH (its sitecustomize runs at start-up)."""
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])]),
    }


def inject(monkeypatch: pytest.MonkeyPatch, **spec: int) -> None:
    """Ask this process's trainer for the faults `spec` (undone with the test)."""
    monkeypatch.setattr(faults, "REQUESTED", faults.FaultSpec(**spec))


def fault_env(spec_file: Path, env: dict[str, str] | None = None, **spec: int) -> dict[str, str]:
    """`env` (default: os.environ) for a command whose training ranks carry out `spec`."""
    faults.FaultSpec(**spec)  # an unknown fault fails here, in the test
    spec_file.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ if env is None else env)
    return {**_on_path(env, HOOKS), ENV: str(spec_file)}


def paced_env(env: dict[str, str], step_s: float, hold: Path | None = None) -> dict[str, str]:
    """`env` for a command whose training steps take at least `step_s` seconds each (the ranks
    sleep out the rest of a faster step; fault_hooks/sitecustomize.py); with `hold`, no step ends
    while that file exists (and a rank that waits on it creates `hold` + ".reached")."""
    held = {"DISTLM_TEST_HOLD": str(hold)} if hold is not None else {}
    return {**_on_path(env, HOOKS), STEP_ENV: str(step_s), **held}


def background_checkpoints_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a command whose training ranks write checkpoints as on a GPU: copied to host
    memory in the loop, written in a thread (fault_hooks/sitecustomize.py)."""
    return {**_on_path(env, HOOKS), "DISTLM_TEST_BACKGROUND_CHECKPOINTS": "1"}


def save_fault_env(env: dict[str, str], *, rank: int, at: str) -> dict[str, str]:
    """`env` for a command whose rank `rank` fails its first sharded checkpoint as a full disk
    would: "open" (rank 0 opening the checkpoint's folder) or "shards" (writing its shards)
    (fault_hooks/sitecustomize.py)."""
    fault = json.dumps({"rank": rank, "at": at})
    return {**_on_path(env, HOOKS), "DISTLM_TEST_SAVE_FAULT": fault}


def slow_reader_env() -> dict[str, str]:
    """os.environ for an MPI command whose rank 1 writes its first error while its proxy is
    stopped (for a second): a launcher slow to read the rank's output."""
    return _on_path(dict(os.environ), SLOW_READER)
