"""The broadcast: metadata exchange, the bucket stream along the chain, and the final verdict."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist

from distlm.documents import (
    Document,
    ReceiverStats,
    TransferStats,
    decode,
    encode,
)
from distlm.log import get_logger
from distlm.transfer.checksum import Checksum
from distlm.transfer.link import Link, Pending
from distlm.transfer.options import TransferError, TransferOptions
from distlm.transfer.plan import Message, Plan, _dtype, _flat_bytes, check_template, make_plan
from distlm.transfer.planes import check_transport, make_plane
from distlm.transfer.watch import Watch

log = get_logger(__name__)

_CALLS = itertools.count()  # every rank calls broadcast_state_dict in the same order


@dataclass
class TransferResult:
    tensors: dict[str, torch.Tensor]
    stats: TransferStats


class MetadataCheck(Document):
    """A receiver's answer to the plan: what does not match its template (empty: all does)."""

    KIND: ClassVar[str] = "distlm-transfer-metadata-check"
    VERSION: ClassVar[int] = 1
    problems: list[str]


class MetadataVerdict(Document):
    """The source's word to every receiver after the checks: the problems by rank (none: go)."""

    KIND: ClassVar[str] = "distlm-transfer-metadata-verdict"
    VERSION: ClassVar[int] = 1
    problems: dict[int, list[str]]


class TransferVerdict(Document):
    """The source's word to every receiver at the end: did every receiver verify."""

    KIND: ClassVar[str] = "distlm-transfer-verdict"
    VERSION: ClassVar[int] = 1
    ok: bool
    error: str


# ----------------------------------------------------------------------------- the broadcast


def broadcast_state_dict(
    tensors: Mapping[str, torch.Tensor] | None,
    *,
    src: int = 0,
    group=None,
    options: TransferOptions | None = None,
) -> TransferResult:
    """Send `tensors` from rank `src` to every rank of `group` (default: the world); see module doc.

    On `src`, `tensors` is the state dict to send. Elsewhere it is a template with the same names,
    shapes and dtypes, filled in place, or None to allocate (on `options.device`, else the CPU for
    gloo and the current CUDA device for NCCL). Raises TransferError on every rank when any rank's
    check fails, a bucket arrives corrupted, or a peer dies or stays silent for `timeout_s`.
    """
    opts = options or TransferOptions()
    if not dist.is_initialized():
        raise TransferError(
            "broadcast_state_dict needs an initialised torch.distributed process group"
        )
    rank = dist.get_rank()
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    if src not in ranks:
        raise TransferError(f"src rank {src} is not in the group (ranks {ranks})")
    if rank not in ranks:
        raise TransferError(f"rank {rank} is not in the group (ranks {ranks})")
    backend = str(dist.get_backend(group))
    chain = [src] + [r for r in ranks if r != src]
    me = chain.index(rank)
    prev = chain[me - 1] if me > 0 else None
    nxt = chain[me + 1] if me + 1 < len(chain) else None
    is_src = rank == src
    if is_src and tensors is None:
        raise TransferError(f"rank {rank} is the source but was given no tensors to send")
    device = _device_for(tensors, opts, backend)
    check_transport(opts.transport, device, backend)
    ctrl_device = device if backend == "nccl" else torch.device("cpu")

    prefix = f"distlm/transfer/{next(_CALLS)}"
    watch = Watch(prefix, rank, chain, opts.timeout_s)
    link = Link(group, ctrl_device, opts.timeout_s, watch)
    plane = None
    try:
        t0 = time.perf_counter()
        plan = (
            make_plan(tensors, bucket_mb=opts.bucket_mb, chunk_mb=opts.chunk_mb) if is_src else None
        )
        plan, dest, staged = _exchange_metadata(link, plan, tensors, chain, rank, device)
        t_meta = time.perf_counter() - t0
        nbuf = min(2, plan.buckets)
        size = min(plan.bucket_bytes, plan.stream_bytes)
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(nbuf)]
        plane = make_plane(
            opts.transport,
            link,
            store=watch.store,
            prefix=prefix,
            rank=rank,
            device=device,
            timeout_s=opts.timeout_s,
        )
        plane.setup(buffers, prev, nxt)
        checksum = Checksum(plan.chunk_bytes, device)
        t1 = time.perf_counter()
        if is_src:
            timing = _send(plan, dest, buffers, plane, link, checksum, nxt)
        else:
            timing = _relay(
                plan, dest, staged, buffers, plane, link, checksum, prev, nxt, rank, opts.fault_hook
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t1
        stats = _stats(plan, opts, backend, device, rank, src, chain, seconds, t_meta, timing)
        stats = _finish(link, stats, chain, rank, src, t1)
    except TransferError as e:
        if not watch.reported:  # a failed wait has already said what happened here
            watch.report(str(e).splitlines()[0])
        raise
    finally:
        if plane is not None:
            plane.close()
        watch.close()
    return TransferResult(dest, stats)


def _device_for(tensors, opts: TransferOptions, backend: str) -> torch.device:
    if tensors:
        devices = {t.device for t in tensors.values() if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise TransferError(f"tensors are on several devices: {sorted(map(str, devices))}")
        if devices:
            return devices.pop()
    if opts.device is not None:
        return torch.device(opts.device)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_metadata(link: Link, plan, tensors, chain, rank, device):
    """Plan down the chain; every receiver checks it and reports; the source says go or stop."""
    src, me = chain[0], chain.index(rank)
    if me == 0:
        blob = json.dumps(plan.to_json()).encode()
        if len(chain) > 1:
            link.send_bytes(blob, chain[1], "metadata")
        problems = {}
        for r in chain[1:]:
            status = decode(link.recv_bytes(r, "metadata check"), MetadataCheck, f"rank {r}")
            if status.problems:
                problems[r] = status.problems
        verdict = encode(MetadataVerdict(problems=problems))
        for r in chain[1:]:
            link.send_bytes(verdict, r, "metadata verdict")
        _raise_problems(problems, "metadata")
        dest = dict(tensors)
        return plan, dest, {}
    blob = link.recv_bytes(chain[me - 1], "metadata")
    if me + 1 < len(chain):
        link.send_bytes(blob, chain[me + 1], "metadata")
    problems, dest, staged = [], {}, {}
    try:
        plan = Plan.from_json(json.loads(blob))
        if tensors is not None:
            problems = check_template(plan, tensors, f"rank {rank}")
    except (TransferError, ValueError, KeyError, TypeError) as e:
        problems = [f"rank {rank}: unreadable metadata from rank {src}: {e}"]
    link.send_bytes(encode(MetadataCheck(problems=problems)), src, "metadata check")
    verdict = decode(link.recv_bytes(src, "metadata verdict"), MetadataVerdict, f"rank {src}")
    _raise_problems(verdict.problems, "metadata")
    dest, staged = _destination(plan, tensors, device)
    return plan, dest, staged


def _raise_problems(problems: dict[int, list[str]], what: str) -> None:
    if problems:
        lines = [p for r in sorted(problems) for p in problems[r]]
        raise TransferError(
            f"{what} check failed on rank {', '.join(map(str, sorted(problems)))}:\n  "
            + "\n  ".join(lines)
        )


def _destination(plan: Plan, template, device):
    """Receiver tensors by name, and for each unique entry the contiguous tensor bytes land in."""
    dest, staged = {}, {}
    for e in plan.entries:
        if e.alias is not None:
            continue
        if template is None:
            t = torch.empty(e.shape, dtype=_dtype(e.dtype), device=device)
            dest[e.name] = t
            staged[e.name] = t
        else:
            t = template[e.name]
            dest[e.name] = t
            staged[e.name] = (
                t if t.is_contiguous() else torch.empty(e.shape, dtype=t.dtype, device=t.device)
            )
    for e in plan.entries:
        if e.alias is not None:
            dest[e.name] = dest[e.alias] if template is None else template[e.name]
    return dest, staged


class MessageView(NamedTuple):
    """The tensor a message travels in (a slice of a tensor, or of the bucket buffer)."""

    view: torch.Tensor
    message: Message


def _message_views(
    plan: Plan, b: int, flats: dict[str, torch.Tensor], buf: torch.Tensor, zero_copy: bool
) -> list[MessageView]:
    out = []
    for m in plan.messages(b, zero_copy):
        if m.direct is not None:
            d = m.direct
            out.append(MessageView(flats[d.entry.name][d.offset : d.offset + d.length], m))
        else:
            out.append(MessageView(buf[m.lo : m.hi], m))
    return out


def _send(plan: Plan, tensors, buffers, plane, link: Link, checksum: Checksum, nxt) -> dict:
    timing = {"pack_seconds": 0.0, "checksum_seconds": 0.0, "packed_bytes": 0}
    flats = {}
    for e in plan.entries:
        if e.alias is None and e.nbytes:
            flats[e.name] = _flat_bytes(tensors[e.name].detach().contiguous())
    pending: list[list] = [[] for _ in buffers]
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
                timing["packed_bytes"] += n
        timing["pack_seconds"] += time.perf_counter() - t
        if nxt is None:
            continue
        for c, (view, _) in enumerate(views):
            pending[slot].append((plane.wait, plane.isend(view, nxt, f"bucket {b} chunk {c}")))
        t = time.perf_counter()  # checksums while the chunks are on the wire
        sums = torch.empty(len(views), 2, dtype=torch.int64, device=buf.device)
        for c, (view, _) in enumerate(views):
            checksum(view, sums[c])
        timing["checksum_seconds"] += time.perf_counter() - t
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
    handles: list
    checksums_handle: Pending
    checksums: torch.Tensor


def _relay(plan, dest, staged, buffers, plane, link, checksum, prev, nxt, rank, hook) -> dict:
    """Receive each bucket from prev chunk by chunk, forward every chunk to nxt at once, check, unpack."""
    timing = {"checksum_seconds": 0.0, "unpack_seconds": 0.0, "packed_bytes": 0}
    flats = {name: _flat_bytes(t) for name, t in staged.items() if t.numel()}
    nb = plan.buckets
    recvs: dict[int, _Posted] = {}
    forwards: list[list] = [[] for _ in buffers]
    mismatches = []

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
                hook(rank, b, c, view)
            if nxt is not None:
                forwards[slot].append((plane.wait, plane.isend(view, nxt, f"bucket {b} chunk {c}")))
            t = time.perf_counter()
            checksum(view, ours[c])
            timing["checksum_seconds"] += time.perf_counter() - t
        link.wait(h_sums)
        if nxt is not None:
            forwards[slot].append((link.wait, link.isend(theirs, nxt, f"checksums of bucket {b}")))
        bad = (ours.to(theirs.device) != theirs).any(dim=1).nonzero().flatten().tolist()
        for c in bad:
            lo, hi = views[c].message.lo, views[c].message.hi
            base = b * plan.bucket_bytes
            mismatches.append(
                {
                    "bucket": b,
                    "chunk": c,
                    "bytes": [base + lo, base + hi],
                    "tensors": plan.tensors_in(b, lo, hi),
                }
            )
        t = time.perf_counter()
        for view, m in views:
            for e, off, n, at in m.pieces:
                flats[e.name][off : off + n].copy_(view[at : at + n])
                timing["packed_bytes"] += n
        timing["unpack_seconds"] += time.perf_counter() - t
    for hs in forwards:
        for wait, h in hs:
            wait(h)
    for name, t in staged.items():
        if t is not dest[name]:
            dest[name].copy_(t)
    timing["mismatches"] = mismatches
    return timing


def _stats(plan, opts, backend, device, rank, src, chain, seconds, t_meta, timing) -> TransferStats:
    mism = timing.pop("mismatches", [])
    payload = plan.payload_bytes
    return TransferStats(
        rank=rank,
        role="sender" if rank == src else "receiver",
        transport=opts.transport,
        backend=backend,
        device=str(device),
        src=src,
        chain=chain,
        bytes=payload,
        stream_bytes=plan.stream_bytes,
        tensors=len(plan.entries),
        tied_tensors=sum(e.alias is not None for e in plan.entries),
        buckets=plan.buckets,
        bucket_bytes=plan.bucket_bytes,
        chunk_bytes=plan.chunk_bytes,
        metadata_seconds=round(t_meta, 6),
        seconds=round(seconds, 6),
        gbps=round(payload / seconds / 1e9, 4) if seconds > 0 else None,
        **{k: round(v, 6) for k, v in timing.items()},
        verified=not mism if rank != src else None,
        mismatches=[
            f"bucket {m['bucket']} chunk {m['chunk']} (stream bytes {m['bytes'][0]}-{m['bytes'][1]}): "
            f"checksum differs from rank {src}'s; tensors {', '.join(m['tensors'])}"
            for m in mism
        ],
    )


def _finish(
    link: Link, stats: TransferStats, chain: list[int], rank: int, src: int, t1: float
) -> TransferStats:
    """Receivers report to the source; it tells all whether everyone verified. Raises if not."""
    if rank != src:
        link.send_bytes(encode(stats), src, "transfer report")
        verdict = decode(link.recv_bytes(src, "transfer verdict"), TransferVerdict, f"rank {src}")
        if not verdict.ok:
            raise TransferError(verdict.error)
        return stats.model_copy(update={"all_verified": True})
    receivers = [
        decode(link.recv_bytes(r, "transfer report"), TransferStats, f"rank {r}") for r in chain[1:]
    ]
    # The sender's clock stops when the last receiver has reported: that is the broadcast time.
    seconds = time.perf_counter() - t1
    bad = [r for r in receivers if not r.verified]
    error = ""
    if bad:
        error = "corrupted data: " + "; ".join(
            f"rank {r.rank}: {m}" for r in bad for m in r.mismatches[:3]
        )
    for r in chain[1:]:
        link.send_bytes(encode(TransferVerdict(ok=not bad, error=error)), r, "transfer verdict")
    if bad:
        raise TransferError(error)
    return stats.model_copy(
        update={
            "seconds": round(seconds, 6),
            "gbps": round(stats.bytes / seconds / 1e9, 4) if seconds > 0 else None,
            "receivers": [
                ReceiverStats(
                    rank=r.rank,
                    seconds=r.seconds,
                    gbps=r.gbps,
                    verified=bool(r.verified),
                    checksum_seconds=r.checksum_seconds,
                    unpack_seconds=r.unpack_seconds,
                    mismatches=r.mismatches,
                )
                for r in receivers
            ],
            "verified": True,
            "all_verified": True,
        }
    )
