"""Test faults of the training stage (`train.fault.*`), armed once at set-up.

`arm` returns None when no fault applies to this rank, and the trainer then does nothing for them
in its step loop: no environment look-up, no call, one `is None` test per step. Armed (a test
asked for one):

- `nan_at_step` N: every rank's loss of step N becomes NaN, so training diverges there;
- `kill_after_step` N: the last rank SIGKILLs itself after step N (and its checkpoint, if one
  falls there), on the job's first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restart
  resumes.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch

from distlm.log import get_logger

log = get_logger("train")


@dataclass(frozen=True)
class Faults:
    nan_at_step: int | None  # the step whose loss becomes NaN (every rank)
    kill_after_step: int | None  # the step after which this rank dies (None: not this rank)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of step `step` (1-based), NaN at `nan_at_step`."""
        if step == self.nan_at_step:
            return loss * float("nan")
        return loss

    def after_step(self, step: int, rank: int) -> None:
        """SIGKILL this process after step `kill_after_step` (logs flushed first)."""
        if step != self.kill_after_step:
            return
        log.warning("train.fault.kill_after_step=%d: killing rank %d", step, rank)
        for h in logging.getLogger("distlm").handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def arm(
    *, nan_at_step: int | None, kill_after_step: int | None, rank: int, world_size: int
) -> Faults | None:
    """The faults this rank carries out, or None when there are none (the usual case)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if kill_after_step is not None and not (first_attempt and rank == world_size - 1):
        kill_after_step = None
    if nan_at_step is None and kill_after_step is None:
        return None
    return Faults(nan_at_step=nan_at_step, kill_after_step=kill_after_step)
