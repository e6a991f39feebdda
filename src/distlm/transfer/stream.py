"""The bucket stream along the chain: the source packs and sends, every receiver relays and checks.

A bucket is packed into one of the two bucket buffers while the other is on the wire (double
buffering). A receiver posts the next bucket's receives ahead, forwards each chunk to its successor
as soon as it has it, computes the chunk's checksum while later chunks are in flight, compares the
checksums with the source's and unpacks into the tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from distlm.transfer.link import Pending
from distlm.transfer.plan import Message, Plan, flat_bytes
from distlm.transfer.session import TransferSession

Tensors = dict[str, torch.Tensor]


class Mismatch(NamedTuple):
    """A chunk whose checksum differs from the source's."""

    bucket: int
    chunk: int
    lo: int  # stream byte range [lo, hi)
    hi: int
    tensors: list[str]  # the tensors with bytes there

    def describe(self, src: int) -> str:
        return (
            f"bucket {self.bucket} chunk {self.chunk} (stream bytes {self.lo}-{self.hi}): "
            f"checksum differs from rank {src}'s; tensors {', '.join(self.tensors)}"
        )


@dataclass
class Timing:
    """What a rank's side of the stream cost, and what its checks found."""

    pack_seconds: float = 0.0  # source: copying small tensors into the bucket buffer
    checksum_seconds: float = 0.0
    unpack_seconds: float = 0.0  # receivers: copying out of the bucket buffer
    packed_bytes: int = 0  # bytes that went through a bucket buffer (not zero-copy)
    mismatches: list[Mismatch] = field(default_factory=list)


class MessageView(NamedTuple):
    """The tensor a message travels in (a slice of a tensor, or of the bucket buffer)."""

    view: torch.Tensor
    message: Message


def _message_views(
    plan: Plan, b: int, flats: Tensors, buf: torch.Tensor, zero_copy: bool
) -> list[MessageView]:
    out = []
    for m in plan.messages(b, zero_copy):
        if m.direct is not None:
            d = m.direct
            out.append(MessageView(flats[d.entry.name][d.offset : d.offset + d.length], m))
        else:
            out.append(MessageView(buf[m.lo : m.hi], m))
    return out


def send(s: TransferSession, tensors: Tensors) -> Timing:
    """The source: pack each bucket, send its messages to the first receiver, then its checksums."""
    plan, plane, link, checksum, buffers, nxt = (
        s.plan,
        s.plane,
        s.link,
        s.checksum,
        s.buffers,
        s.nxt,
    )
    timing = Timing()
    flats = {}
    for e in plan.entries:
        if e.alias is None and e.nbytes:
            flats[e.name] = flat_bytes(tensors[e.name].detach().contiguous())
    pending: list[list[tuple[Any, Any]]] = [[] for _ in buffers]
    keep = []  # checksum tensors in flight
    for b in range(plan.buckets):
        slot = b % len(buffers)
        for wait, h in pending[slot]:
            wait(h)
        pending[slot] = []
        buf = buffers[slot]
        views = _message_views(plan, b, flats, buf, plane.zero_copy)
        t = time.perf_counter()
        for view, m in views:
            for e, off, n, at in m.pieces:
                view[at : at + n].copy_(flats[e.name][off : off + n])
                timing.packed_bytes += n
        timing.pack_seconds += time.perf_counter() - t
        if nxt is None:
            continue
        for c, (view, _) in enumerate(views):
            pending[slot].append((plane.wait, plane.isend(view, nxt, f"bucket {b} chunk {c}")))
        t = time.perf_counter()  # checksums while the chunks are on the wire
        sums = torch.empty(len(views), 2, dtype=torch.int64, device=buf.device)
        for c, (view, _) in enumerate(views):
            checksum(view, sums[c])
        timing.checksum_seconds += time.perf_counter() - t
        sums = sums.to(link.device)
        keep.append(sums)
        pending[slot].append((link.wait, link.isend(sums, nxt, f"checksums of bucket {b}")))
    for hs in pending:
        for wait, h in hs:
            wait(h)
    return timing


class _Posted(NamedTuple):
    """A bucket's receives, posted ahead: its messages, their handles, and its checksums'."""

    views: list[MessageView]
    handles: list[Any]
    checksums_handle: Pending
    checksums: torch.Tensor


def relay(s: TransferSession, dest: Tensors, staged: Tensors) -> Timing:
    """A receiver: receive each bucket from prev chunk by chunk, forward every chunk to nxt at
    once, check, unpack into `staged`, then copy into `dest` where those differ."""
    plan, plane, link, checksum, buffers = s.plan, s.plane, s.link, s.checksum, s.buffers
    prev, nxt, hook = s.prev, s.nxt, s.fault_hook
    assert prev is not None  # a receiver
    timing = Timing()
    flats = {name: flat_bytes(t) for name, t in staged.items() if t.numel()}
    nb = plan.buckets
    recvs: dict[int, _Posted] = {}
    forwards: list[list[tuple[Any, Any]]] = [[] for _ in buffers]

    def post(b: int) -> None:
        slot = b % len(buffers)
        for wait, h in forwards[slot]:  # the slot's previous bucket must have left before reuse
            wait(h)
        forwards[slot] = []
        views = _message_views(plan, b, flats, buffers[slot], plane.zero_copy)
        hs = [plane.irecv(view, prev, f"bucket {b} chunk {c}") for c, (view, _) in enumerate(views)]
        theirs = torch.empty(len(views), 2, dtype=torch.int64, device=link.device)
        recvs[b] = _Posted(views, hs, link.irecv(theirs, prev, f"checksums of bucket {b}"), theirs)

    if nb:
        post(0)
    for b in range(nb):
        slot = b % len(buffers)
        if b + 1 < nb:
            post(b + 1)
        views, hs, h_sums, theirs = recvs.pop(b)
        ours = torch.empty(len(views), 2, dtype=torch.int64, device=buffers[slot].device)
        for c, ((view, _), h) in enumerate(zip(views, hs)):
            plane.wait(h)
            if hook is not None:
                hook(s.rank, b, c, view)
            if nxt is not None:
                forwards[slot].append((plane.wait, plane.isend(view, nxt, f"bucket {b} chunk {c}")))
            t = time.perf_counter()
            checksum(view, ours[c])
            timing.checksum_seconds += time.perf_counter() - t
        link.wait(h_sums)
        if nxt is not None:
            forwards[slot].append((link.wait, link.isend(theirs, nxt, f"checksums of bucket {b}")))
        bad = (ours.to(theirs.device) != theirs).any(dim=1).nonzero().flatten().tolist()
        base = b * plan.bucket_bytes
        for c in bad:
            lo, hi = views[c].message.lo, views[c].message.hi
            timing.mismatches.append(
                Mismatch(b, c, base + lo, base + hi, plan.tensors_in(b, lo, hi))
            )
        t = time.perf_counter()
        for view, m in views:
            for e, off, n, at in m.pieces:
                flats[e.name][off : off + n].copy_(view[at : at + n])
                timing.packed_bytes += n
        timing.unpack_seconds += time.perf_counter() - t
    for hs in forwards:
        for wait, h in hs:
            wait(h)
    for name, t in staged.items():
        if t is not dest[name]:
            dest[name].copy_(t)
    return timing
