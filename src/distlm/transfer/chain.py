"""`broadcast_state_dict`: one state dict from one rank to every rank of a group (see the package doc).

The steps, each in its module: open a session (distlm.transfer.session), agree on the plan
(handshake), stream the buckets along the chain (stream), agree on the result (handshake).
The broadcast *stage* of the workflow, which calls this, is distlm.broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlm.runtime.device import synchronize
from distlm.settings import TransferSettings
from distlm.transfer import handshake, stream
from distlm.transfer.documents import TransferStats
from distlm.transfer.errors import TransferError
from distlm.transfer.peers import Peers
from distlm.transfer.plan import make_plan
from distlm.transfer.session import FaultHook, TransferSession


@dataclass
class TransferResult:
    tensors: dict[str, torch.Tensor]  # the received (or sent) tensors; a template filled in place
    stats: TransferStats


def broadcast_state_dict(
    tensors: Mapping[str, torch.Tensor] | None,
    *,
    settings: TransferSettings,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    peers: Peers | None = None,
    device: str | torch.device | None = None,
    fault_hook: FaultHook | None = None,
) -> TransferResult:
    """Send `tensors` from rank `src` to every rank of `group` (default: the world), or of
    `peers` (a group of its own: distlm.transfer.peers).

    On `src`, `tensors` is the state dict to send. Elsewhere it is a template with the same names,
    shapes and dtypes, filled in place, or None to allocate (on `device`, else the CPU for gloo
    and the current CUDA device for NCCL). Every rank passes the same `settings`. Raises
    TransferError on every rank when any rank's check fails, a bucket arrives corrupted, or a peer
    dies or stays silent for `settings.timeout_s`. `fault_hook` is for tests (see session.py).
    """
    if peers is None:
        peers = Peers.world(group)
    elif group is not None:
        raise TransferError("broadcast_state_dict: give a group or peers, not both")
    s = TransferSession.open(
        settings, tensors, src=src, peers=peers, device=device, fault_hook=fault_hook
    )
    try:
        t0 = time.perf_counter()
        plan = None
        if s.is_src:
            assert tensors is not None  # TransferSession.open checked
            plan = make_plan(tensors, bucket_mb=settings.bucket_mb, chunk_mb=settings.chunk_mb)
        plan, dest, staged = handshake.exchange_metadata(s, plan, tensors)
        t_meta = time.perf_counter() - t0
        s.start(plan)
        t1 = time.perf_counter()
        timing = stream.send(s, dest) if s.is_src else stream.relay(s, dest, staged)
        synchronize(s.device)
        seconds = time.perf_counter() - t1
        stats = handshake.finish(s, _stats(s, seconds, t_meta, timing), t1)
    except TransferError as e:
        s.fail(e)
        raise
    finally:
        s.close()
    return TransferResult(dest, stats)


def _stats(
    s: TransferSession, seconds: float, t_meta: float, timing: stream.Timing
) -> TransferStats:
    return TransferStats(
        rank=s.rank,
        role="sender" if s.is_src else "receiver",
        transport=s.settings.transport,
        backend=s.backend,
        device=str(s.device),
        src=s.src,
        chain=s.chain,
        **s.plan.stats_fields(seconds),
        metadata_seconds=round(t_meta, 6),
        pack_seconds=round(timing.pack_seconds, 6),
        checksum_seconds=round(timing.checksum_seconds, 6),
        unpack_seconds=round(timing.unpack_seconds, 6),
        packed_bytes=timing.packed_bytes,
        verified=not timing.mismatches if not s.is_src else None,
        mismatches=[m.describe(s.src) for m in timing.mismatches],
    )
