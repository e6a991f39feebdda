"""Test faults of the training stage, armed once at set-up.

The test harness asks for them, never the user's config: `REQUESTED` is None unless a test sets
it (in process), or tests/harness/fault_hooks, a `sitecustomize` a test puts on a rank's
PYTHONPATH, sets it from the JSON file the DISTLM_TEST_FAULTS environment variable names.

`arm` returns None when no fault applies to this rank, and the trainer then does nothing for them
in its step loop: no look-up, no call, one `is None` test per step. Armed (a test asked for one):

- `nan_at_step` N: every rank's loss of step N becomes NaN, so training diverges there;
- `kill_after_step` N: the last rank SIGKILLs itself after step N (and its checkpoint, if one
  falls there), on the job's first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restart
  resumes;
- `kill_mid_push` N: rank 0 SIGKILLs itself in the middle of step N's push into a following
  server (distlm.train.pushes): the first stage has its part, the last stage's is not sent; on the
  first attempt only.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distlm.core.log import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger("train")


@dataclass(frozen=True)
class FaultSpec:
    """What a test asks for (each None: not asked)."""

    nan_at_step: int | None = None  # every rank's loss of this step becomes NaN
    kill_after_step: int | None = None  # the last rank SIGKILLs itself after this step
    kill_mid_push: int | None = None  # rank 0 SIGKILLs itself in the middle of this step's push


REQUESTED: FaultSpec | None = None  # set by the test harness only (see above)


@dataclass(frozen=True)
class Faults:
    nan_at_step: int | None  # the step whose loss becomes NaN (every rank)
    kill_after_step: int | None  # the step after which this rank dies (None: not this rank)
    kill_mid_push: int | None = None  # the step in whose push this rank dies (None: not this rank)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of step `step` (1-based), NaN at `nan_at_step`."""
        if step == self.nan_at_step:
            return loss * float("nan")
        return loss

    def after_step(self, step: int, rank: int) -> None:
        """SIGKILL this process after step `kill_after_step` (logs flushed first)."""
        if step != self.kill_after_step:
            return
        _die(f"test fault kill_after_step={step}: killing rank {rank}")

    def push_hook(self, step: int) -> Callable[[int, int, Mapping], None] | None:
        """For step `step`'s push: a hook the sender calls before each stage's part
        (distlm.transfer.push.PushSender.send) that kills this process before the last stage's,
        once the first stage has its part."""
        if step != self.kill_mid_push:
            return None

        def hook(stage: int, stages: int, sent: Mapping) -> None:
            if stages < 2 or stage != stages - 1:
                return
            deadline = time.monotonic() + 60
            while 0 not in sent and time.monotonic() < deadline:
                time.sleep(0.01)
            _die(
                f"test fault kill_mid_push={step}: killing rank 0 with stage {stage}'s part unsent"
            )

        return hook


def _die(why: str) -> None:
    log.warning("%s", why)
    for h in logging.getLogger("distlm").handlers:
        h.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(*, rank: int, world_size: int, spec: FaultSpec | None = None) -> Faults | None:
    """The faults of `spec` (default: REQUESTED) this rank carries out, or None when there are
    none (the usual case)."""
    spec = REQUESTED if spec is None else spec
    if spec is None:
        return None
    nan_at_step, kill_after_step = spec.nan_at_step, spec.kill_after_step
    kill_mid_push = spec.kill_mid_push
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if kill_after_step is not None and not (first_attempt and rank == world_size - 1):
        kill_after_step = None
    if kill_mid_push is not None and not (first_attempt and rank == 0):
        kill_mid_push = None
    if nan_at_step is None and kill_after_step is None and kill_mid_push is None:
        return None
    return Faults(nan_at_step, kill_after_step, kill_mid_push)
