"""The time-limit warning that reaches a training rank before its step loop does.

`distlm-launch srun-torchrun --signal-before` sends SIGUSR1 to every process of the job's steps
(distlm.launch). The step loop acts on it at a step boundary: a checkpoint, a StopNotice for the
launcher, a requeue (distlm.train.trainer installs the handler for the loop). A rank still starting
when the warning comes (importing torch, joining the rendezvous, loading the model and the
checkpoint it resumes: tens of seconds on a busy node, in an allocation that starts late) must not
lose it. It inherits the torchrun agent's disposition, SIG_IGN, so the warning would be dropped
and the training would run on into the time limit's SIGTERM: a stop the launcher does not requeue,
and the job ends short of its requeues.

`latch()`, the first thing the training entry does (before torch is imported), records a SIGUSR1
from then on; the step loop reads `warned()` when it starts and stops at its first step boundary,
with a checkpoint, as for a warning during the loop (the step's all-reduce carries it to every
rank). Only the warning is latched: a SIGTERM before the loop still ends the rank at once, as
nothing is trained yet that a checkpoint would keep. A warning in the milliseconds between the
rank's exec and `latch()` is still lost.

`ignore()`, the last thing the entry does, ignores the warning from then on. The launcher sends it
again every few seconds until the ranks end, so it can reach a rank that has finished its work
and is exiting; Python's exit puts a signal that has a Python handler back to its default action,
for SIGUSR1 death. A finished training would end with its ranks killed, torchrun failing and no
StopNotice: the launcher would fail the job, and Snakemake would remove the final folder. SIG_IGN
is kept through the exit.
"""

from __future__ import annotations

import signal

WARNING = signal.SIGUSR1
_warned = False


def _on_warning(_signum: int, _frame) -> None:
    global _warned
    _warned = True


def latch() -> None:
    """From now on a SIGUSR1 is recorded (read with `warned()`), not dropped or fatal."""
    signal.signal(WARNING, _on_warning)


def ignore() -> None:
    """From now on a SIGUSR1 is ignored: the rank's work is over (finished, stopped or failed)."""
    signal.signal(WARNING, signal.SIG_IGN)


def warned() -> bool:
    """Whether a SIGUSR1 came since `latch()`."""
    return _warned
