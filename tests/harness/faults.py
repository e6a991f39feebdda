"""Test faults of the training stage, asked for by a test and never by the user's config.

In process, a test sets `distlm.train.faults.REQUESTED` (`inject`). For a stage started as the
user starts it (torchrun, Snakemake), `fault_env` writes the spec as JSON, names it in
DISTLM_TEST_FAULTS and puts tests/harness/fault_hooks on PYTHONPATH: that folder's
`sitecustomize` reads the spec in every training rank (RANK set) before the trainer starts.
`paced_env` sets a floor on each training step's time the same way (DISTLM_TEST_STEP_S).
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


def inject(monkeypatch: pytest.MonkeyPatch, **spec: int) -> None:
    """Ask this process's trainer for the faults `spec` (undone with the test)."""
    monkeypatch.setattr(faults, "REQUESTED", faults.FaultSpec(**spec))


def fault_env(spec_file: Path, env: dict[str, str] | None = None, **spec: int) -> dict[str, str]:
    """`env` (default: os.environ) for a command whose training ranks carry out `spec`."""
    faults.FaultSpec(**spec)  # an unknown fault fails here, in the test
    spec_file.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ if env is None else env)
    path = [str(HOOKS), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, ENV: str(spec_file), "PYTHONPATH": os.pathsep.join(path)}


def paced_env(env: dict[str, str], step_s: float) -> dict[str, str]:
    """`env` for a command whose training steps take at least `step_s` seconds each (the ranks
    sleep out the rest of a faster step; fault_hooks/sitecustomize.py)."""
    path = [str(HOOKS), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, STEP_ENV: str(step_s), "PYTHONPATH": os.pathsep.join(path)}
