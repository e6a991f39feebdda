"""One transfer's state, created once per call: who takes part, where the bytes live, what moves them.

    session = TransferSession.open(settings, tensors, src=0, peers=Peers.world(), device=None)
    try:
        ...                      # handshake.exchange_metadata(session, ...), then
        session.start(plan)      # bucket buffers, data plane, checksum
        ...                      # stream.send(session, ...) or stream.relay(session, ...)
    finally:
        session.close()

Every rank opens a session with the same settings; the chain runs src -> the other ranks of the
peers (distlm.transfer.peers: the torch.distributed world, or a group of its own) in order, each forwarding to its successor (`nxt`) what it receives from its predecessor
(`prev`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from distlm.runtime.device import group_device, host
from distlm.settings import TransferSettings
from distlm.transfer.checksum import Checksum
from distlm.transfer.errors import TransferError
from distlm.transfer.link import Link
from distlm.transfer.peers import Peers
from distlm.transfer.plan import Plan
from distlm.transfer.planes import Plane, TorchPlane, check_transport
from distlm.transfer.uccl import UcclPlane
from distlm.transfer.watch import Watch

# Test hook, receivers only: called as hook(rank, bucket, chunk, data) after each chunk arrives and
# before it is forwarded or checked; tests corrupt `data` or kill the process there.
FaultHook = Callable[[int, int, int, torch.Tensor], None]

_CALLS = itertools.count()  # every rank opens its sessions in the same order: one store prefix each


@dataclass(eq=False)
class TransferSession:
    """The state of one transfer on one rank; the broadcast's steps are functions of it."""

    settings: TransferSettings  # transport, bucket_mb, chunk_mb, timeout_s: the same on every rank
    peers: Peers  # who takes part, and how their messages go
    backend: str  # the peers' backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    rank: int  # this process's global rank
    chain: list[int]  # src first, then the group's other ranks in order
    device: torch.device  # where the tensors and the bucket buffers live
    prefix: str  # this transfer's keys in the torch.distributed store
    watch: Watch  # heartbeats; on a failed wait, names the rank that stopped
    link: Link  # control messages over the group, each wait bounded by timeout_s
    fault_hook: FaultHook | None = None
    # Set by start() once the metadata exchange has agreed on the plan:
    _plan: Plan | None = field(default=None, init=False, repr=False)
    _plane: Plane | None = field(default=None, init=False, repr=False)
    _checksum: Checksum | None = field(default=None, init=False, repr=False)
    buffers: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

    @classmethod
    def open(
        cls,
        settings: TransferSettings,
        tensors: Mapping[str, torch.Tensor] | None,
        *,
        src: int,
        peers: Peers,
        device: str | torch.device | None,
        fault_hook: FaultHook | None = None,
    ) -> TransferSession:
        """Check the peers, the source and the transport here, then start the heartbeat."""
        rank, ranks, backend = peers.rank, peers.ranks, peers.backend
        if src not in ranks:
            raise TransferError(f"src rank {src} is not in the group (ranks {ranks})")
        if rank not in ranks:
            raise TransferError(f"rank {rank} is not in the group (ranks {ranks})")
        chain = [src] + [r for r in ranks if r != src]
        if rank == src and tensors is None:
            raise TransferError(f"rank {rank} is the source but was given no tensors to send")
        where = _device_for(tensors, device, backend)
        check_transport(settings.transport, where, backend)
        ctrl_device = where if backend == "nccl" else host()
        prefix = f"distlm/transfer/{next(_CALLS)}"
        watch = Watch(peers.store, prefix, rank, chain, settings.timeout_s)
        link = Link(peers, ctrl_device, settings.timeout_s, watch)
        return cls(settings, peers, backend, rank, chain, where, prefix, watch, link, fault_hook)

    @property
    def src(self) -> int:
        return self.chain[0]

    @property
    def is_src(self) -> bool:
        return self.rank == self.src

    @property
    def receivers(self) -> list[int]:
        return self.chain[1:]

    @property
    def prev(self) -> int | None:
        """The rank this one receives from (None on the source)."""
        me = self.chain.index(self.rank)
        return self.chain[me - 1] if me > 0 else None

    @property
    def nxt(self) -> int | None:
        """The rank this one forwards to (None at the end of the chain)."""
        me = self.chain.index(self.rank)
        return self.chain[me + 1] if me + 1 < len(self.chain) else None

    def start(self, plan: Plan) -> None:
        """Allocate the two bucket buffers, connect the data plane and make the checksum."""
        nbuf = min(2, plan.buckets)
        size = min(plan.bucket_bytes, plan.stream_bytes)
        self._plan = plan
        self.buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(nbuf)
        ]
        self._plane = self._make_plane()
        self._plane.setup(self.buffers, self.prev, self.nxt)
        self._checksum = Checksum(plan.chunk_bytes, self.device)

    def _make_plane(self) -> Plane:
        """The data plane of `settings.transport` (check_transport has said it can run)."""
        if self.settings.transport == "torch":
            return TorchPlane(self.link)
        return UcclPlane(
            self.link,
            store=self.watch.store,
            prefix=self.prefix,
            rank=self.rank,
            device=self.device,
            timeout_s=self.settings.timeout_s,
        )

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise TransferError(
                f"rank {self.rank}: no plan yet (start() comes after the handshake)"
            )
        return self._plan

    @property
    def plane(self) -> Plane:
        if self._plane is None:
            raise TransferError(f"rank {self.rank}: no data plane yet (start() sets it up)")
        return self._plane

    @property
    def checksum(self) -> Checksum:
        if self._checksum is None:
            raise TransferError(f"rank {self.rank}: no checksum yet (start() makes it)")
        return self._checksum

    def fail(self, err: TransferError) -> None:
        """Tell the other ranks through the store what failed here (once)."""
        if not self.watch.reported:  # a failed wait has already said what happened here
            self.watch.report(str(err).splitlines()[0])

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
        self.watch.close()


def _device_for(
    tensors: Mapping[str, torch.Tensor] | None, device: str | torch.device | None, backend: str
) -> torch.device:
    """The tensors' device; without tensors `device`, else the backend's (cuda for NCCL)."""
    if tensors:
        devices = {t.device for t in tensors.values() if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise TransferError(f"tensors are on several devices: {sorted(map(str, devices))}")
        if devices:
            return devices.pop()
    if device is not None:
        return torch.device(device)
    return group_device(backend)
