"""Who takes part in a transfer and how their point-to-point messages go: `Peers`.

    Peers.world(group)                       # ranks of the torch.distributed world (or a group of it)
    Peers.own(store, rank, size, backend)    # a group of its own, on a store of its own

A transfer runs over either. The world is what training and the broadcast stage have. A group of
its own is what a push from training into a running server needs (distlm.transfer.push): the two
sides are separate jobs, each with its own torch.distributed world or none, so the group is made
from a store both reach, as vLLM's StatelessProcessGroup and SGLang's weight-update group do,
without touching either job's world.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from distlm.runtime.device import gpu_count
from distlm.transfer.errors import TransferError


@dataclass(eq=False)
class Peers:
    """The ranks of one transfer: `rank` (this process), `ranks` (all, in group order), the
    backend ("gloo": CPU tensors, "nccl": CUDA tensors) and the store its heartbeats go to."""

    rank: int
    ranks: list[int]
    backend: str
    store: Store | None
    _group: Any = (
        None  # world: the torch.distributed group (None: the world); own: the ProcessGroup
    )
    _own: bool = False

    @classmethod
    def world(cls, group: dist.ProcessGroup | None = None) -> Peers:
        """The torch.distributed world's ranks (or `group`'s), by their global ranks."""
        if not dist.is_initialized():
            raise TransferError(
                "broadcast_state_dict needs an initialised torch.distributed process group "
                "(or a group of its own: distlm.transfer.Peers.own)"
            )
        ranks = (
            dist.get_process_group_ranks(group)
            if group is not None
            else list(range(dist.get_world_size()))
        )
        return cls(dist.get_rank(), ranks, str(dist.get_backend(group)), _default_store(), group)

    @classmethod
    def own(cls, store: Store, rank: int, size: int, backend: str, timeout_s: float) -> Peers:
        """A group of `size` ranks of its own on `store` (every rank passes the same store
        prefix), of `backend`: "gloo" (host memory) or "nccl" (GPU memory, each rank on a GPU of
        its own: NCCL refuses two ranks on one GPU); joining waits for the others at most
        `timeout_s`, and so does each NCCL operation (its watchdog then aborts the group)."""
        timeout = _dt.timedelta(seconds=timeout_s)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            if not dist.is_nccl_available() or gpu_count() == 0:
                raise TransferError(
                    f"a group of its own over nccl: torch {torch.__version__} has no NCCL or "
                    "sees no GPU here"
                )
            # as torch.distributed makes its own groups (distributed_c10d's
            # _new_process_group_helper), on the given store instead of the world's
            opts = dist.ProcessGroupNCCL.Options()  # pyright: ignore[reportAttributeAccessIssue]
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(  # pyright: ignore[reportAttributeAccessIssue]
                store, rank, size, opts
            )
        else:
            raise TransferError(f"a group of its own over {backend!r}: gloo or nccl")
        return cls(rank, list(range(size)), backend, store, pg, True)

    def isend(self, t: torch.Tensor, peer: int, tag: int):
        if self._own:
            return self._group.send([t], peer, tag)
        return dist.isend(t, peer, group=self._group, tag=tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int):
        if self._own:
            return self._group.recv([t], peer, tag)
        return dist.irecv(t, peer, group=self._group, tag=tag)

    def close(self) -> None:
        """A group of its own is shut down (the world's belongs to its job)."""
        if self._own and self._group is not None:
            try:
                self._group.shutdown()
            except Exception:  # gloo's shutdown is best effort; the object goes either way
                pass
            self._group = None


def _default_store() -> Store | None:
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:
        return None
