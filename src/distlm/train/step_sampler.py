"""A deterministic distributed sampler over the train blocks, addressed by optimizer step.

The sample stream is an endless sequence of epochs; epoch `e` visits every block once in the order
`randperm(n_blocks, seed=(seed, e))`. Optimizer step `s` consumes stream positions
[s * G, (s + 1) * G) where G is the global batch (micro_batch * grad_accum * world_size); rank r
takes the contiguous slice [r * B, (r + 1) * B) of it (B = micro_batch * grad_accum) and splits it
into `grad_accum` micro-batches. The position is a pure function of the step, so a checkpoint needs
only the step (and the identity of the stream) to resume exactly, and each rank reads from the
token store's shards only the rows it trains on, ahead of the step (StepLoader).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from distlm import DistlmError
from distlm.data import TokenBlocks
from distlm.runtime.device import DeviceBackend
from distlm.settings.train import BatchPlan, plan_batch

__all__ = ["BatchPlan", "StepLoader", "StepSampler", "plan_batch"]


class StepSampler:
    """Block indices of every (step, rank, micro-step), drawn from seeded per-epoch permutations."""

    def __init__(self, n_blocks: int, plan: BatchPlan, rank: int, seed: int) -> None:
        if n_blocks <= 0:
            raise DistlmError("the train split has no blocks: nothing to train on")
        self.n_blocks = n_blocks
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n_blocks, generator=g).numpy()
            self._perm_epoch = epoch
        return self._perm

    def positions(self, step: int) -> np.ndarray:
        """Stream positions this rank reads for optimizer step `step` (0-based)."""
        start = step * self.plan.global_batch + self.rank * self.plan.per_rank
        return np.arange(start, start + self.plan.per_rank, dtype=np.int64)

    def indices(self, step: int) -> np.ndarray:
        """Block indices for `step`, shape (grad_accum, micro_batch)."""
        pos = self.positions(step)
        epochs, offsets = np.divmod(pos, self.n_blocks)
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[offsets[sel]]
        return out.reshape(self.plan.grad_accum, self.plan.micro_batch)

    def epoch_of(self, step: int) -> float:
        return step * self.plan.global_batch / self.n_blocks

    def state(self) -> dict:
        """What a checkpoint records to check that a resume reads the same stream."""
        return {
            "n_blocks": self.n_blocks,
            "seed": self.seed,
            "global_batch": self.plan.global_batch,
            "micro_batch": self.plan.micro_batch,
            "grad_accum": self.plan.grad_accum,
            "world_size": self.plan.world_size,
        }


class StepLoader:
    """One step's micro-batches for this rank: the rows are read from the token store's memory
    maps by a background thread `AHEAD` steps ahead (a step's rows are a function of the step, so
    reading ahead changes nothing), pinned there on a GPU, and moved to the device when asked.
    `wait_s`: how long the last call waited for its rows (nothing, once the reads keep ahead)."""

    AHEAD = 2

    def __init__(self, blocks: TokenBlocks, sampler: StepSampler, hw: DeviceBackend) -> None:
        self.blocks = blocks
        self.sampler = sampler
        self.hw = hw  # the device backend: where the batch goes, and how
        self.wait_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distlm-data")
        self._ahead: dict[int, Future[torch.Tensor]] = {}

    def _host(self, step: int) -> torch.Tensor:
        idx = self.sampler.indices(step)
        rows = torch.from_numpy(self.blocks.rows(idx.reshape(-1)))
        if self.hw.pin_host:  # pinned here, so that the copy below does not wait for it
            rows = rows.pin_memory()
        return rows.view(*idx.shape, -1)

    def __call__(self, step: int) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        ahead = self._ahead.pop(step, None)
        rows = ahead.result() if ahead is not None else self._host(step)
        self.wait_s = time.perf_counter() - t0
        for s in [s for s in self._ahead if s < step]:  # a jump back (a resume): not needed
            self._ahead.pop(s).cancel()
        for s in range(step + 1, step + 1 + self.AHEAD):
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(self._host, s)
        rows = self.hw.to_device(rows)  # asynchronous where the device is a GPU
        return list(rows.unbind(0))  # grad_accum x (micro, T)

    def close(self) -> None:
        for f in self._ahead.values():
            f.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
