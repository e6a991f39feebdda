"""The background writer of training checkpoints (`CheckpointWriter`): one write at a time, in a
thread of its own where the device backend says so (`DeviceBackend.background_checkpoints`: on
a GPU, where a checkpoint of GPT-2 small with AdamW is ~1 GB and its write stalled an H100's loop
3.9 s) or in the caller's; the host copies it writes from (pinned buffers kept from save to
save); torch.distributed.checkpoint's asynchronous saves of each rank's shards; and the gloo group
on which the ranks agree on each save's outcome (`agree`), so that a failure on any rank fails
every rank with one error. What a checkpoint holds and how it is written, verified and pruned is
distlm.train.checkpoint's; the save path that uses this writer is distlm.train.checkpoint_save.
"""

from __future__ import annotations

import datetime as _dt
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlm.runtime.device import CopiesDone, is_gpu
from distlm.runtime.dist import agree


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time: in a background thread (`background`) or in the
    caller's. `wait` returns when the last one is on disk, raising its error if it failed.

    A background write reads host copies that `stage` makes, in buffers kept from save to save.
    With `pinned` (a GPU: distlm.runtime.device's `pin_host`) they are page-locked, and the copies are
    queued on the device's stream without waiting, as torchtitan's async checkpoint stages into
    pinned memory. `save`'s closing barrier synchronises that stream (NCCL's barrier does), so the
    loop stalls for the copies at the rate of pinned memory (tens of ms for GPT-2 small with
    AdamW, ~1.5 GB), not for a pageable copy (which stalled an H200's loop 1.36 s) or the write.
    Stream order keeps the next steps' updates behind the copies; the write waits for them before
    it reads."""

    def __init__(
        self, *, background: bool, pinned: bool = False, timeout_s: float | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(1, "checkpoint") if background else None
        self._pending: Future | None = None
        self._pinned = pinned
        self._timeout_s = timeout_s  # the gloo groups' (transfer.timeout_s); None: torch's
        self._buffers: dict[tuple, torch.Tensor] = {}  # host copies by place in the tree
        self._groups: dict[str, Any] = {}  # gloo groups by use: "agree", "shards"
        self._stager: Any = None  # save_shards' DCP stager, kept from save to save
        self.write_s: list[float] = []  # each write's own seconds, in the order written

    @property
    def background(self) -> bool:
        return self._pool is not None

    def reserve(self, tree) -> None:
        """Allocate the host buffers that `stage` copies `tree` into (the shapes it will have at
        every save), in the background thread while training goes on: pinning the ~1.5 GB of
        GPT-2 small with AdamW takes a while, which the first save would otherwise stall for (it
        holds the CUDA driver's lock, so the steps meanwhile may be slower: a one-time cost of the
        early steps). Nothing without a background thread or once the buffers exist."""
        if self._pool is None or self._buffers:
            return
        specs: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self._walk(tree, (), lambda where, t: specs.setdefault(where, (t.shape, t.dtype)))
        self.wait()
        self._pending = self._pool.submit(self._allocate, specs)

    def _allocate(self, specs: dict[tuple, tuple[torch.Size, torch.dtype]]) -> None:
        for where, (shape, dtype) in specs.items():
            self._buffers[where] = torch.empty(shape, dtype=dtype, pin_memory=self._pinned)

    def stage(self, tree):
        """`tree` (state dicts, optimizer states: dicts, lists and tuples of tensors and numbers)
        with its tensors copied into this writer's host buffers, once the last write is done
        with them: what a background write reads while training goes on changing the originals.
        Returns (the copy, the event the copies end at: None when they are done already)."""
        self.wait()
        copy = self._copy(tree, ())
        if not self._pinned:
            return copy, None
        return copy, CopiesDone()  # after the copies, on the stream that queued them

    def _copy(self, tree, where: tuple):
        def copy(where: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = self._buffers.get(where)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pinned)
                self._buffers[where] = buf
            return buf.copy_(t.detach(), non_blocking=self._pinned)

        return self._walk(tree, where, copy)

    @classmethod
    def _walk(cls, tree, where: tuple, fn):
        """`tree` with fn(place, tensor) in place of each tensor (dicts, lists, tuples kept)."""
        if isinstance(tree, torch.Tensor):
            return fn(where, tree)
        if isinstance(tree, dict):
            return {k: cls._walk(v, (*where, k), fn) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(cls._walk(v, (*where, i), fn) for i, v in enumerate(tree))
        return tree

    def save_shards(self, tree, where: Path) -> Future:
        """Every rank: its shards of `tree` (DTensors' local parts) copied to host memory here
        (pinned where `pinned`, into buffers DCP's stager keeps from save to save), then written
        into `where` by torch.distributed.checkpoint's `async_save` in a thread of its own,
        whose future ends once every rank's shards and the metadata are on disk. Its collectives
        go through a gloo group of their own, made at the first call (all ranks call in step):
        NCCL's cannot run in a thread beside the training's, as torchtitan's async checkpoint
        does it. Waited on where this writer writes here and now (not `background`)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save

        self.wait()  # the previous save's shards: their host buffers are the stager's again
        group = self.group("shards")
        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=self._pinned,
                use_shared_memory=False,
                use_async_staging=False,  # copied here: the loop changes the originals next
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        written = async_save(
            tree, checkpoint_id=where, process_group=group, async_stager=self._stager
        )
        assert isinstance(written, Future)  # staged here (not use_async_staging)
        return written

    def submit(self, write, *args, ready: CopiesDone | None = None, **kwargs) -> Path | None:
        """Write after the previous write (and, in the background, after `ready`: the staged
        copies); the path when written here, None when in the background (`wait` gives it)."""
        self.wait()
        if self._pool is None:
            return write(*args, **kwargs)
        self._pending = self._pool.submit(self._when_ready, ready, write, *args, **kwargs)
        return None

    @staticmethod
    def _when_ready(ready: CopiesDone | None, write, *args, **kwargs):
        if ready is not None:
            ready.synchronize()
        return write(*args, **kwargs)

    def settle(self) -> float:
        """Wait for the last write to be on disk (its error is raised); the seconds waited."""
        t0 = time.perf_counter()
        self.wait()
        return time.perf_counter() - t0

    def wait(self) -> Path | None:
        """The last background write's path once it is on disk (None if there was none)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def group(self, use: str):
        """A gloo group of this writer's for `use` ("agree": the ranks' outcomes of each save;
        "shards": torch.distributed.checkpoint's collectives, which run in a thread beside the
        loop's). Both are made at the first use of either, which every rank reaches together (a
        save's first agreement): making one is a collective of its own, which a rank that failed
        before it would never join. Their timeout is the transfer's (transfer.timeout_s), which
        bounds every wait on another rank here."""
        if not self._groups:
            timeout = None if self._timeout_s is None else _dt.timedelta(seconds=self._timeout_s)
            for name in ("agree", "shards"):
                self._groups[name] = dist.new_group(backend="gloo", timeout=timeout)
        return self._groups[use]

    def agree(self, what: str, error: BaseException | None, payload=None) -> list:
        """Every rank's outcome of one step of a save (distlm.runtime.dist.agree, over this writer's
        gloo group): one rank's failure raises the same error, naming it, on every rank."""
        return agree(what, error, payload=payload, group=self.group("agree"))

    def settled(self, what: str) -> float:
        """All ranks: wait for this rank's last write (`settle`), then agree on how every rank's
        went: a background write that failed on any rank (a full disk) fails every rank here,
        with one error naming it. The seconds this rank waited."""
        error, waited = None, 0.0
        try:
            waited = self.settle()
        except Exception as e:
            error = e
        self.agree(what, error)
        return waited

    def close(self) -> None:
        """Wait for the last write (its error is raised), then let the thread go."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers.clear()
            if self._stager is not None:
                self._stager.close()


def host_copy(tree):
    """`tree` with each tensor copied to host memory, a tensor of its own (a view's copy holds
    the view alone: torch.save writes a tensor's whole storage)."""
    return CheckpointWriter._walk(
        tree, (), lambda _, t: t.detach().cpu() if is_gpu(t.device) else t.detach().clone()
    )
