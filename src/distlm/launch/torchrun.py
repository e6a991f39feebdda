"""The torchrun command of a torch.distributed stage, written once: the workflow's rules (after the
profile's launcher, `{resources.torchrun}`), the benchmarks and the tests start the stages with it.

    stage_args("train", nproc=2, max_restarts=0, args=["--config", "train.json", ...])
    # ["--nproc-per-node=2", "--max-restarts=0", "-m", "distlm.entry.train", "--config", ...]
    local_torchrun(stage_args(...))   # python -m torch.distributed.run --standalone ...
    train_args(config=..., tokens=..., tokenizer=..., model=..., out=..., rank_log=...)
    # the train stage's own arguments, as rule train gives them (benchmarks, tests)

The rules give placeholders (`nproc="{params.nproc}"`), so the rule's shell command is the same
text as a hand-written one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from os import PathLike


def stage_args(
    entry: str,
    *,
    nproc: int | str,
    args: Sequence[str],
    max_restarts: int | str | None = None,
    launcher: Sequence[str] = (),
) -> list[str]:
    """torchrun's arguments for stage entry point `distlm.entry.<entry>`: its ranks a node (a
    count, or "gpu": one per GPU), the restarts (None: torchrun's default, none), `launcher`
    options of torchrun's own (a monitor interval), then the module and `args`."""
    restarts = [] if max_restarts is None else [f"--max-restarts={max_restarts}"]
    return [
        f"--nproc-per-node={nproc}",
        *restarts,
        *launcher,
        "-m",
        f"distlm.entry.{entry}",
        *args,
    ]


def local_torchrun(args: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """The command that runs `stage_args` on this machine alone, as the local profile does
    (`torchrun --standalone`)."""
    return [python, "-m", "torch.distributed.run", "--standalone", *args]


def train_args(
    *,
    config: str | PathLike,
    tokens: str | PathLike,
    tokenizer: str | PathLike,
    model: str | PathLike,
    out: str | PathLike,
    rank_log: str | PathLike | None = None,
) -> list[str]:
    """The train stage's arguments (distlm.entry.train's: its resolved config, its inputs, its
    output folder, and a per-rank log with `{rank}` in it), as rule train gives them, for a
    command that starts the stage by hand (`stage_args("train", ..., args=train_args(...))`)."""
    args = ["--config", str(config), "--tokens", str(tokens), "--tokenizer", str(tokenizer)]
    args += ["--model", str(model), "--out", str(out)]
    return args + ([] if rank_log is None else ["--rank-log", str(rank_log)])
