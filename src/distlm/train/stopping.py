"""Why a training run stops early: divergence, and the signals that ask for a checkpoint and a
clean stop at the next step boundary (the step's all-reduce carries them to every rank)."""

from __future__ import annotations

import signal

from distlm import DistlmError


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
