"""Why a training run stops early: divergence, and the signals that ask for a checkpoint and a
clean stop at the next step boundary (the step's all-reduce carries them to every rank)."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.train.documents import STOP_NOTICE_ENV, StopNotice

__all__ = ["STOP_NOTICE_ENV", "StopNotice", "write_stop_notice"]


class TrainingDiverged(DistlmError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class TrainingStopped(DistlmError):
    """A signal (a SLURM time limit or preemption, scancel, a kill) asked the ranks to stop: they
    wrote a checkpoint at the step boundary and exit non-zero; a rerun resumes from it."""


# Signals that ask for a checkpoint and a clean stop at the next step boundary: SIGTERM (SLURM's
# time limit, preemption and scancel send it, torchrun forwards it) and SIGUSR1 (sent ahead of the
# time limit by `distlm-launch srun-torchrun --signal-before`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def stop_reason(signalled: list[float], world_size: int) -> str:
    """'SIGTERM on 2 of 4 ranks, ...' from the per-signal rank counts the step all-reduced."""
    return ", ".join(
        f"{sig.name} on {n:.0f} of {world_size} ranks"
        for sig, n in zip(STOP_SIGNALS, signalled, strict=True)
        if n
    )


def stop_signals(signalled: list[float]) -> list[str]:
    """['SIGUSR1', ...]: the STOP_SIGNALS that reached at least one rank, in their order."""
    return [sig.name for sig, n in zip(STOP_SIGNALS, signalled, strict=True) if n]


def write_stop_notice(notice: StopNotice, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Rank 0, after the checkpoint of `notice.step` is durable: write `notice` where
    `distlm-launch srun-torchrun` asked (STOP_NOTICE_ENV); None when no launcher asked (a local
    run, torchrun by hand)."""
    where = environ.get(STOP_NOTICE_ENV)
    if not where:
        return None
    write_document(where, notice)
    return Path(where)
