"""What the processes of a command loaded and what their start-up cost (process_hooks/
sitecustomize.py): `process_env` for the command, `process_records` after it."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "DISTLM_TEST_PROCESS"
HOOKS = Path(__file__).resolve().parent / "process_hooks"


def process_env(folder: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) for a command each of whose Python processes writes a record
    into `folder` when it exits."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    path = os.pathsep.join([str(HOOKS), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, "PYTHONPATH": path, ENV: str(folder)}


def process_records(folder: Path) -> list[dict]:
    """The records the processes wrote: argv, modules, first_step_cpu_s, exit_cpu_s."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def entry_point(record: dict) -> str | None:
    """The distlm entry point a process ran (`train` for `python -m distlm.entry.train`)."""
    argv0 = Path(record["argv"][0]) if record["argv"] else None
    if argv0 is not None and argv0.parent.name == "entry" and argv0.parent.parent.name == "distlm":
        return argv0.stem
    return None
