"""The engine of `distlm.transfer`: the plan, checksums, links, data planes and the broadcast."""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

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
from distlm.transfer.options import TRANSPORTS, TransferError, TransferOptions
from distlm.transfer.uccl import UcclPlane, check_uccl

log = get_logger(__name__)

ALIGN = 64  # byte alignment of every tensor in the stream: any dtype view is legal
DIRECT_MIN = 64 * 1024  # a tensor segment this large travels from/into the tensor itself, unpacked
_HEARTBEAT_S = 1.0
_PROTOCOL = "distlm-transfer/1"
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


# ----------------------------------------------------------------------------- the plan


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

    def to_json(self) -> dict:
        return {
            "protocol": _PROTOCOL,
            "stream_bytes": self.stream_bytes,
            "bucket_bytes": self.bucket_bytes,
            "chunk_bytes": self.chunk_bytes,
            "entries": [
                [e.name, list(e.shape), e.dtype, e.start, e.nbytes, e.alias] for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        if d.get("protocol") != _PROTOCOL:
            raise TransferError(f"sender speaks {d.get('protocol')!r}, this rank {_PROTOCOL!r}")
        entries = tuple(Entry(n, tuple(s), t, a, nb, al) for n, s, t, a, nb, al in d["entries"])
        return cls(entries, d["stream_bytes"], d["bucket_bytes"], d["chunk_bytes"])


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
                    _dtype_name(t.dtype),
                    seen[key].start,
                    nbytes,
                    seen[key].name,
                )
            )
            continue
        e = Entry(name, tuple(t.shape), _dtype_name(t.dtype), pos, nbytes)
        entries.append(e)
        if key is not None:
            seen[key] = e
        pos = _align(pos + nbytes)
    return Plan(tuple(entries), pos, bucket, chunk)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in the sender's metadata")
    return dt


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
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
        elif _dtype_name(t.dtype) != e.dtype:
            problems.append(
                f"{where}: tensor {e.name!r} has dtype {_dtype_name(t.dtype)} here, the sender sends {e.dtype}"
            )
    devices = {t.device for t in template.values()}
    if len(devices) > 1:
        problems.append(
            f"{where}: template tensors are on several devices {sorted(map(str, devices))}"
        )
    return problems


# ----------------------------------------------------------------------------- checksums


class _Checksum:
    """128-bit linear checksum of a message, mod 2^64, computed in one pass on its device.

    The message's 64-bit words are cut into rows of ROW words (1 KiB); with s_r the sum of row r,
    d0 = sum_r a_r s_r and d1 = sum_r b_r s_r, with random odd weights a, b. Any changed word,
    dropped, duplicated, zeroed or misplaced row changes both (odd weights are invertible mod 2^64);
    what it cannot see is a change that keeps every row's sum (two words of one row swapped). That is
    the price of one streaming reduction at memory speed, next to the transfer it guards: an
    integrity check of the transport, not a cryptographic digest.
    """

    ROW = 128  # words per row

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0x5EED)
        rows = max_bytes // (8 * self.ROW) + 2
        w = torch.randint(-(2**62), 2**62, (2, rows), dtype=torch.int64, generator=g) | 1
        self.weights = w.to(device)

    def __call__(self, data: torch.Tensor, out: torch.Tensor) -> None:
        if data.storage_offset() % 8:  # rare: a view into a tensor at an odd offset
            data = data.clone()
        n8 = data.numel() // 8 * 8
        words = data[:n8].view(torch.int64)
        full = words.numel() // self.ROW
        sums = words[: full * self.ROW].view(full, self.ROW).sum(1)  # (rows,)
        tail = words[full * self.ROW :].sum().reshape(1)  # < ROW words: one more row
        if n8 < data.numel():  # the last < 8 bytes, as one zero-padded word in that row
            last = torch.zeros(8, dtype=torch.uint8, device=data.device)
            last[: data.numel() - n8] = data[n8:]
            tail = tail + last.view(torch.int64)
        sums = torch.cat([sums, tail])
        out.copy_((self.weights[:, : sums.numel()] * sums).sum(1))


# ----------------------------------------------------------------------------- links and liveness


class Pending(NamedTuple):
    """A posted send or receive: what to wait on, and what to name when it fails."""

    work: Any
    peer: int
    what: str


class _Link:
    """Point-to-point messages over a torch.distributed group, each wait bounded by timeout_s."""

    def __init__(self, group, device: torch.device, timeout_s: float, watch: _Watch) -> None:
        self.group = group
        self.device = device  # where control tensors live (cuda for NCCL)
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.watch = watch
        self._tags: dict[tuple[str, int], int] = {}

    def _tag(self, kind: str, peer: int) -> int:
        n = self._tags.get((kind, peer), 0)
        self._tags[(kind, peer)] = n + 1
        return n % (2**31)

    def isend(self, t: torch.Tensor, peer: int, what: str):
        try:
            work = dist.isend(t, peer, group=self.group, tag=self._tag("out", peer))
        except Exception as e:
            self.watch.fail(peer, f"sending {what}", e)
        return Pending(work, peer, f"sending {what}")

    def irecv(self, t: torch.Tensor, peer: int, what: str):
        try:
            work = dist.irecv(t, peer, group=self.group, tag=self._tag("in", peer))
        except Exception as e:
            self.watch.fail(peer, f"receiving {what}", e)
        return Pending(work, peer, f"receiving {what}")

    def wait(self, handle: Pending) -> None:
        work, peer, what = handle
        try:
            work.wait(self.timeout)
        except Exception as e:
            self.watch.fail(peer, what, e)

    def send_bytes(self, blob: bytes, peer: int, what: str) -> None:
        n = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        self.wait(self.isend(n, peer, f"{what} (length)"))
        if blob:
            payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
            self.wait(self.isend(payload, peer, what))

    def recv_bytes(self, peer: int, what: str) -> bytes:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.wait(self.irecv(n, peer, f"{what} (length)"))
        size = int(n.item())
        if size == 0:
            return b""
        payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.wait(self.irecv(payload, peer, what))
        return payload.cpu().numpy().tobytes()


class _Watch:
    """Heartbeats in the torch.distributed store; on a failed wait, finds the rank that stopped."""

    def __init__(self, prefix: str, rank: int, ranks: list[int], timeout_s: float) -> None:
        self.prefix, self.rank, self.ranks = prefix, rank, ranks
        self.reported = False
        self.store = _default_store()
        self._stop = threading.Event()
        self._thread = None
        self.probe_s = max(2.5 * _HEARTBEAT_S, min(5.0, timeout_s / 4))
        if self.store is not None:
            self._thread = threading.Thread(
                target=self._beat, name="distlm-transfer-heartbeat", daemon=True
            )
            self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self._key("hb", self.rank), 1)
            except Exception:  # the store is gone: the failure shows up in the data path
                return
            self._stop.wait(_HEARTBEAT_S)

    def close(self, *, done: bool = True) -> None:
        self._stop.set()
        if self.store is not None and done:
            try:
                self.store.set(self._key("done", self.rank), "1")
            except Exception:
                pass

    def _reported(self) -> dict[int, str]:
        out = {}
        for r in self.ranks:
            try:
                if self.store.check([self._key("failed", r)]):
                    out[r] = self.store.get(self._key("failed", r)).decode()
            except Exception:
                break
        return out

    def diagnose(self) -> str:
        """Which ranks stopped beating, else which reported a failure (a few seconds of probing)."""
        if self.store is None:
            return ""
        try:
            before = {
                r: self.store.add(self._key("hb", r), 0) for r in self.ranks if r != self.rank
            }
            time.sleep(self.probe_s)
            after = {r: self.store.add(self._key("hb", r), 0) for r in before}
            done = {r for r in before if self.store.check([self._key("done", r)])}
        except Exception as e:
            return f"the torch.distributed store is unreachable ({type(e).__name__}), so rank 0's host may be gone"
        dead = [r for r in before if after[r] == before[r] and r not in done]
        if dead:
            return (
                "rank "
                + ", ".join(map(str, dead))
                + f" stopped (no heartbeat for {self.probe_s:.1f} s)"
            )
        reported = {r: why for r, why in self._reported().items() if r != self.rank}
        return "; ".join(f"rank {r} failed: {why}" for r, why in reported.items())

    def fail(self, peer: int, what: str, err: BaseException) -> None:
        text = _short(err)
        kind = "timed out" if "timeout" in text.lower() or "timed out" in text.lower() else "failed"
        here = f"{what} with rank {peer} {kind} ({type(err).__name__}: {text})"
        cause = self.diagnose()
        self.report(here)  # others see what happened here, not this rank's guess about the cause
        msg = f"rank {self.rank}: {cause}. Here: {here}" if cause else f"rank {self.rank}: {here}"
        raise TransferError(msg) from None

    def report(self, msg: str) -> None:
        self.reported = True
        if self.store is not None:
            try:
                self.store.set(self._key("failed", self.rank), msg[:300])
            except Exception:
                pass
        self.close(done=False)


def _short(err: BaseException) -> str:
    """The gist of a backend error: without gloo's source path and boilerplate advice."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0][:160]


def _default_store():
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:
        return None


# ----------------------------------------------------------------------------- data planes


class TorchPlane:
    """Bulk data over torch.distributed point-to-point (NCCL or gloo), straight from the given views."""

    name = "torch"
    zero_copy = True  # chunks inside one tensor are sent from / received into the tensor itself

    def __init__(self, link: _Link) -> None:
        self.link = link

    def setup(self, buffers: list[torch.Tensor], prev: int | None, nxt: int | None) -> None:
        pass

    def isend(self, view: torch.Tensor, peer: int, what: str):
        return self.link.isend(view, peer, what)

    def irecv(self, view: torch.Tensor, peer: int, what: str):
        return self.link.irecv(view, peer, what)

    def wait(self, handle) -> None:
        self.link.wait(handle)

    def close(self) -> None:
        pass


def check_transport(transport: str, device: torch.device, backend: str) -> None:
    """Raise TransferError saying why `transport` cannot run here; never substitutes another."""
    if transport == "torch":
        if backend == "nccl" and device.type != "cuda":
            raise TransferError(
                f"transport torch with backend nccl needs CUDA tensors, these are on {device}"
            )
        if backend == "gloo" and device.type != "cpu":
            raise TransferError(
                f"transport torch with backend gloo moves CPU tensors; these are on {device} (use nccl)"
            )
        return
    if transport == "uccl":
        check_uccl(device)
        return
    raise TransferError(f"unknown transport {transport!r} ({', '.join(TRANSPORTS)})")


def _make_plane(transport: str, link: _Link, **kw):
    if transport == "torch":
        return TorchPlane(link)
    return UcclPlane(link, **kw)


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
    watch = _Watch(prefix, rank, chain, opts.timeout_s)
    link = _Link(group, ctrl_device, opts.timeout_s, watch)
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
        plane = _make_plane(
            opts.transport,
            link,
            store=watch.store,
            prefix=prefix,
            rank=rank,
            device=device,
            timeout_s=opts.timeout_s,
        )
        plane.setup(buffers, prev, nxt)
        checksum = _Checksum(plan.chunk_bytes, device)
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


def _exchange_metadata(link: _Link, plan, tensors, chain, rank, device):
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


def _send(plan: Plan, tensors, buffers, plane, link: _Link, checksum: _Checksum, nxt) -> dict:
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
    link: _Link, stats: TransferStats, chain: list[int], rank: int, src: int, t1: float
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
