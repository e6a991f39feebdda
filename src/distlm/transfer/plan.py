"""The bucket plan: every tensor's place in one aligned byte stream, cut into buckets and chunks.

Pure data, no I/O: `make_plan` lays the sender's tensors out (tied tensors once), `Plan` answers
where each byte of each bucket comes from, which messages a bucket travels in, and which tensors a
byte range holds; `check_template` compares the plan with a receiver's template. Change the bucket
layout or the zero-copy rule here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from distlm.transfer.errors import TransferError

ALIGN = 64  # byte alignment of every tensor in the stream: any dtype view is legal
DIRECT_MIN = 64 * 1024  # a tensor segment this large travels from/into the tensor itself, unpacked


@dataclass(frozen=True)
class Entry:
    """One tensor in the byte stream; an alias (a tied tensor) has no bytes of its own."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int  # byte offset in the stream
    nbytes: int
    alias: str | None = None  # name of the tensor it shares storage with


class Piece(NamedTuple):
    """Bytes of one tensor inside a bucket or a message."""

    entry: Entry
    offset: int  # byte offset in the tensor
    length: int
    at: int  # byte offset in the bucket (in a message: in the message)


class Message(NamedTuple):
    """One message a bucket travels in: bytes [lo, hi) of the bucket. A `direct` message is sent
    from and received into one tensor's memory (no packing); otherwise its `pieces` are packed."""

    lo: int
    hi: int
    pieces: tuple[Piece, ...] = ()
    direct: Piece | None = None


@dataclass(frozen=True)
class Plan:
    entries: tuple[Entry, ...]
    stream_bytes: int  # aligned length of the stream
    bucket_bytes: int
    chunk_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.alias is None)

    @property
    def buckets(self) -> int:
        return max(1, -(-self.stream_bytes // self.bucket_bytes)) if self.stream_bytes else 0

    def stats_fields(self, seconds: float) -> dict[str, Any]:
        """The fields of a TransferStats that the plan and the transfer's time give: what every
        transfer of this plan reports, whichever way it moved the bytes."""
        payload = self.payload_bytes
        return {
            "bytes": payload,
            "stream_bytes": self.stream_bytes,
            "tensors": len(self.entries),
            "tied_tensors": sum(e.alias is not None for e in self.entries),
            "buckets": self.buckets,
            "bucket_bytes": self.bucket_bytes,
            "chunk_bytes": self.chunk_bytes,
            "seconds": round(seconds, 6),
            "gbps": round(payload / seconds / 1e9, 4) if seconds > 0 else None,
        }

    def bucket_range(self, b: int) -> tuple[int, int]:
        lo = b * self.bucket_bytes
        return lo, min(lo + self.bucket_bytes, self.stream_bytes)

    def chunks(self, b: int) -> list[tuple[int, int]]:
        """Chunk byte ranges of bucket b, relative to the bucket start."""
        lo, hi = self.bucket_range(b)
        n = hi - lo
        return [(c, min(c + self.chunk_bytes, n)) for c in range(0, n, self.chunk_bytes)]

    def pieces(self, b: int) -> list[Piece]:
        """The tensor bytes in bucket b, in stream order (`at` relative to the bucket)."""
        return self._pieces[b] if b < len(self._pieces) else []

    @functools.cached_property
    def _pieces(self) -> list[list[Piece]]:
        out: list[list] = [[] for _ in range(self.buckets)]
        for e in self.entries:  # entries are in stream order: one pass over tensors and buckets
            if e.alias is not None or e.nbytes == 0:
                continue
            pos, end = e.start, e.start + e.nbytes
            while pos < end:
                b = pos // self.bucket_bytes
                lo, hi = self.bucket_range(b)
                z = min(end, hi)
                out[b].append(Piece(e, pos - e.start, z - pos, pos - lo))
                pos = z
        return out

    def segments(self, b: int, lo: int, hi: int) -> list[Piece]:
        """The pieces of bytes [lo, hi) of bucket b (`at` relative to the bucket)."""
        out = []
        for e, off, n, at in self.pieces(b):
            a, z = max(lo, at), min(hi, at + n)
            if a < z:
                out.append(Piece(e, off + a - at, z - a, a))
        return out

    def messages(self, b: int, zero_copy: bool) -> tuple[Message, ...]:
        """The messages bucket b travels in, byte ranges relative to the bucket.

        Without zero copy a message is one chunk of the packed bucket. With it, a segment of at
        least DIRECT_MIN bytes (or a whole chunk) inside one tensor is its own `direct` message,
        sent from and received into the tensor's memory; the small segments between are packed
        in runs (`pieces`, `at` relative to the message). Messages never cross a chunk boundary,
        so forwarding stays chunk-grained.
        """
        key = (b, zero_copy)
        if key not in self._messages:
            self._messages[key] = self._layout(b, zero_copy)
        return self._messages[key]

    @functools.cached_property
    def _messages(self) -> dict:
        return {}

    def _layout(self, b: int, zero_copy: bool) -> tuple[Message, ...]:
        direct_min = min(DIRECT_MIN, self.chunk_bytes // 4)
        out: list[Message] = []

        def packed(run: list[Piece], lo: int, hi: int) -> None:
            if run:
                out.append(Message(lo, hi, tuple(p._replace(at=p.at - lo) for p in run)))

        for lo, hi in self.chunks(b):
            segs = self.segments(b, lo, hi)
            if not zero_copy:  # every chunk, padding included, is one packed message
                out.append(Message(lo, hi, tuple(p._replace(at=p.at - lo) for p in segs)))
                continue
            run: list[Piece] = []
            for p in segs:
                if p.length >= direct_min or p.length == hi - lo:
                    if run:
                        packed(run, run[0].at, run[-1].at + run[-1].length)
                    run = []
                    out.append(Message(p.at, p.at + p.length, direct=p._replace(at=0)))
                else:
                    run.append(p)
            if run:
                packed(run, run[0].at, run[-1].at + run[-1].length)
        return tuple(out)

    def tensors_in(self, b: int, lo: int = 0, hi: int | None = None) -> list[str]:
        """Names of the tensors with bytes in [lo, hi) of bucket b."""
        base = b * self.bucket_bytes
        hi = self.bucket_range(b)[1] - base if hi is None else hi
        return [
            e.name
            for e in self.entries
            if e.alias is None
            and e.nbytes
            and e.start < base + hi
            and e.start + e.nbytes > base + lo
        ]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _storage_key(t: torch.Tensor):
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
    )


def make_plan(tensors: Mapping[str, torch.Tensor], *, bucket_mb: float, chunk_mb: float) -> Plan:
    """Lay the tensors out in one aligned byte stream; tied tensors (same storage view) once."""
    chunk = max(ALIGN, _align(int(chunk_mb * 2**20)))
    bucket = max(chunk, -(-int(bucket_mb * 2**20) // chunk) * chunk)  # a whole number of chunks
    entries, seen, pos = [], {}, 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TransferError(f"tensor {name!r}: not a torch.Tensor ({type(t).__name__})")
        nbytes = t.numel() * t.element_size()
        key = _storage_key(t) if nbytes else None
        if key is not None and key in seen:
            entries.append(
                Entry(
                    name,
                    tuple(t.shape),
                    dtype_name(t.dtype),
                    seen[key].start,
                    nbytes,
                    seen[key].name,
                )
            )
            continue
        e = Entry(name, tuple(t.shape), dtype_name(t.dtype), pos, nbytes)
        entries.append(e)
        if key is not None:
            seen[key] = e
        pos = _align(pos + nbytes)
    return Plan(tuple(entries), pos, bucket, chunk)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in the sender's metadata")
    return dt


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


def check_template(plan: Plan, template: Mapping[str, torch.Tensor], where: str) -> list[str]:
    """Problems between what arrives and the receiver's template; each names the tensor."""
    problems = []
    names = [e.name for e in plan.entries]
    missing = [n for n in names if n not in template]
    extra = [n for n in template if n not in set(names)]
    if missing:
        problems.append(
            f"{where}: the sender sends tensor {missing[0]!r} which the template lacks ({len(missing)} such)"
        )
    if extra:
        problems.append(f"{where}: template tensor {extra[0]!r} is not sent ({len(extra)} such)")
    for e in plan.entries:
        t = template.get(e.name)
        if t is None:
            continue
        if tuple(t.shape) != e.shape:
            problems.append(
                f"{where}: tensor {e.name!r} has shape {tuple(t.shape)} here, the sender sends {e.shape}"
            )
        elif dtype_name(t.dtype) != e.dtype:
            problems.append(
                f"{where}: tensor {e.name!r} has dtype {dtype_name(t.dtype)} here, the sender sends {e.dtype}"
            )
    devices = {t.device for t in template.values()}
    if len(devices) > 1:
        problems.append(
            f"{where}: template tensors are on several devices {sorted(map(str, devices))}"
        )
    return problems
