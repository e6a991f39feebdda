"""Send a state dict from one rank to every other rank: bucketed, pipelined, verified.

    from distlm.transfer import broadcast_state_dict, TransferOptions
    opts = TransferOptions(transport="torch", bucket_mb=64, chunk_mb=4, timeout_s=120)
    result = broadcast_state_dict(sd if topo.is_main else template_or_None, src=0, options=opts)
    result.tensors   # the received (or sent) dict; a template is filled in place
    result.stats     # JSON-able figures: bytes, buckets, seconds, GB/s, verified, transport, ...

How it moves the bytes (what NCCL's ring broadcast and RL weight-sync engines do):
- Metadata first: names, shapes, dtypes and byte offsets of every tensor in one virtual byte
  stream (tied tensors travel once). Every receiver checks it against its template and reports to
  the source, which tells everyone to go or to stop, so a mismatch stops all ranks with one error.
- The stream is cut into buckets (`bucket_mb`); a bucket is packed into one of two flat buffers
  while the other is on the wire (double buffering), and may split a tensor.
- Ranks form a chain src -> r1 -> r2 -> ... Each bucket travels in chunks (`chunk_mb`); a receiver
  forwards chunk c to its successor as soon as it has it, while chunk c+1 is arriving. Every link
  carries the model once, so N receivers take about as long as one.
- Each chunk carries a 128-bit linear checksum (sum and position-weighted sum of its 64-bit words,
  mod 2^64, computed with torch on the buffer's device); receivers compute it while later chunks
  are in flight and compare it with the sender's before the weights are used. A mismatch names the
  bucket, the byte range and the tensors in it.
- Every wait has a timeout (`timeout_s`); ranks beat a heartbeat into the torch.distributed store,
  so when a peer dies or hangs the error names the rank that stopped, not just the neighbour.

Transports: "torch" (torch.distributed point-to-point: NCCL for GPU tensors, gloo for CPU) and
"uccl" (UCCL's P2P engine for the bulk data, torch.distributed for the small control messages;
see distlm.transfer_uccl). A transport that cannot run raises TransferError saying why.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.log import get_logger

log = get_logger(__name__)

TRANSPORTS = ("torch", "uccl")
ALIGN = 64  # byte alignment of every tensor in the stream: any dtype view is legal
DIRECT_MIN = 64 * 1024  # a tensor segment this large travels from/into the tensor itself, unpacked
_HEARTBEAT_S = 1.0
_PROTOCOL = "distlm-transfer/1"
_CALLS = itertools.count()  # every rank calls broadcast_state_dict in the same order


class TransferError(DistlmError):
    """A transfer failed: the message names the rank, tensor or bucket at fault."""


@dataclass(frozen=True)
class TransferOptions:
    """How to move the weights. Every rank of the group passes the same options."""

    transport: str = "torch"  # "torch" (NCCL/gloo point-to-point) or "uccl" (UCCL P2P engine)
    bucket_mb: float = 64  # flat bucket size; two buckets are allocated per rank
    chunk_mb: float = 4  # relay granularity along the chain; smaller = earlier forwarding
    timeout_s: float = 120  # longest wait for any single message before the peer is declared dead
    device: str | torch.device | None = None  # receivers without a template: where to allocate
    # Test hook, receivers only: called as hook(rank, bucket, chunk, data) after each chunk arrives
    # and before it is forwarded or checked; tests corrupt `data` or kill the process here.
    fault_hook: Callable[[int, int, int, torch.Tensor], None] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise TransferError(f"broadcast.transport: unknown transport {self.transport!r} ({', '.join(TRANSPORTS)})")
        for name in ("bucket_mb", "chunk_mb", "timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise TransferError(f"broadcast.{name}: must be a positive number, got {v!r}")

    @classmethod
    def from_config(cls, section: Mapping[str, Any], **kw) -> "TransferOptions":
        """From the config's `broadcast:` section (transport, bucket_mb, chunk_mb, timeout_s)."""
        keys = ("transport", "bucket_mb", "chunk_mb", "timeout_s")
        return cls(**{k: section[k] for k in keys if k in section}, **kw)


@dataclass
class TransferResult:
    tensors: dict[str, torch.Tensor]
    stats: dict[str, Any]


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

    def pieces(self, b: int) -> list[tuple[Entry, int, int, int]]:
        """(entry, byte offset in tensor, length, byte offset in bucket) for bucket b."""
        return self._pieces[b] if b < len(self._pieces) else []

    @functools.cached_property
    def _pieces(self) -> list[list[tuple[Entry, int, int, int]]]:
        out: list[list] = [[] for _ in range(self.buckets)]
        for e in self.entries:  # entries are in stream order: one pass over tensors and buckets
            if e.alias is not None or e.nbytes == 0:
                continue
            pos, end = e.start, e.start + e.nbytes
            while pos < end:
                b = pos // self.bucket_bytes
                lo, hi = self.bucket_range(b)
                z = min(end, hi)
                out[b].append((e, pos - e.start, z - pos, pos - lo))
                pos = z
        return out

    def segments(self, b: int, lo: int, hi: int) -> list[tuple[Entry, int, int, int]]:
        """(entry, byte offset in tensor, length, byte offset in bucket) for bytes [lo, hi) of bucket b."""
        out = []
        for e, off, n, at in self.pieces(b):
            a, z = max(lo, at), min(hi, at + n)
            if a < z:
                out.append((e, off + a - at, z - a, a))
        return out

    def messages(self, b: int, zero_copy: bool) -> tuple[tuple[int, int, tuple], ...]:
        """The messages bucket b travels in: (lo, hi, segments), byte range relative to the bucket.

        Without zero copy a message is one chunk of the packed bucket. With it, a segment of at
        least DIRECT_MIN bytes (or a whole chunk) inside one tensor is its own message, sent from
        and received into the tensor's memory (segments == ((entry, tensor offset),)); the small
        segments between are packed in runs (segments == ((entry, tensor offset, length, offset in
        message), ...)). Messages never cross a chunk boundary, so forwarding stays chunk-grained.
        """
        key = (b, zero_copy)
        if key not in self._messages:
            self._messages[key] = self._layout(b, zero_copy)
        return self._messages[key]

    @functools.cached_property
    def _messages(self) -> dict:
        return {}

    def _layout(self, b: int, zero_copy: bool) -> tuple[tuple[int, int, tuple], ...]:
        direct_min = min(DIRECT_MIN, self.chunk_bytes // 4)
        out: list = []

        def packed(run: list) -> None:
            if run:
                a = run[0][3]
                out.append((a, run[-1][3] + run[-1][2], tuple((e, off, n, at - a) for e, off, n, at in run)))

        for lo, hi in self.chunks(b):
            segs = self.segments(b, lo, hi)
            if not zero_copy:
                out.append((lo, hi, tuple((e, off, n, at - lo) for e, off, n, at in segs)))
                continue
            run: list = []
            for e, off, n, at in segs:
                if n >= direct_min or n == hi - lo:
                    packed(run)
                    run = []
                    out.append((at, at + n, ((e, off),)))
                else:
                    run.append((e, off, n, at))
            packed(run)
        return tuple(out)

    def tensors_in(self, b: int, lo: int = 0, hi: int | None = None) -> list[str]:
        """Names of the tensors with bytes in [lo, hi) of bucket b."""
        base = b * self.bucket_bytes
        hi = self.bucket_range(b)[1] - base if hi is None else hi
        return [
            e.name for e in self.entries
            if e.alias is None and e.nbytes and e.start < base + hi and e.start + e.nbytes > base + lo
        ]

    def to_json(self) -> dict:
        return {
            "protocol": _PROTOCOL,
            "stream_bytes": self.stream_bytes,
            "bucket_bytes": self.bucket_bytes,
            "chunk_bytes": self.chunk_bytes,
            "entries": [[e.name, list(e.shape), e.dtype, e.start, e.nbytes, e.alias] for e in self.entries],
        }

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if d.get("protocol") != _PROTOCOL:
            raise TransferError(f"sender speaks {d.get('protocol')!r}, this rank {_PROTOCOL!r}")
        entries = tuple(Entry(n, tuple(s), t, a, nb, al) for n, s, t, a, nb, al in d["entries"])
        return cls(entries, d["stream_bytes"], d["bucket_bytes"], d["chunk_bytes"])


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _storage_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


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
            entries.append(Entry(name, tuple(t.shape), _dtype_name(t.dtype), seen[key].start, nbytes, seen[key].name))
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
        problems.append(f"{where}: the sender sends tensor {missing[0]!r} which the template lacks ({len(missing)} such)")
    if extra:
        problems.append(f"{where}: template tensor {extra[0]!r} is not sent ({len(extra)} such)")
    for e in plan.entries:
        t = template.get(e.name)
        if t is None:
            continue
        if tuple(t.shape) != e.shape:
            problems.append(f"{where}: tensor {e.name!r} has shape {tuple(t.shape)} here, the sender sends {e.shape}")
        elif _dtype_name(t.dtype) != e.dtype:
            problems.append(f"{where}: tensor {e.name!r} has dtype {_dtype_name(t.dtype)} here, the sender sends {e.dtype}")
    devices = {t.device for t in template.values()}
    if len(devices) > 1:
        problems.append(f"{where}: template tensors are on several devices {sorted(map(str, devices))}")
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


class _Link:
    """Point-to-point messages over a torch.distributed group, each wait bounded by timeout_s."""

    def __init__(self, group, device: torch.device, timeout_s: float, watch: "_Watch") -> None:
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
        return (work, peer, f"sending {what}")

    def irecv(self, t: torch.Tensor, peer: int, what: str):
        try:
            work = dist.irecv(t, peer, group=self.group, tag=self._tag("in", peer))
        except Exception as e:
            self.watch.fail(peer, f"receiving {what}", e)
        return (work, peer, f"receiving {what}")

    def wait(self, handle) -> None:
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
            self._thread = threading.Thread(target=self._beat, name="distlm-transfer-heartbeat", daemon=True)
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
            before = {r: self.store.add(self._key("hb", r), 0) for r in self.ranks if r != self.rank}
            time.sleep(self.probe_s)
            after = {r: self.store.add(self._key("hb", r), 0) for r in before}
            done = {r for r in before if self.store.check([self._key("done", r)])}
        except Exception as e:
            return f"the torch.distributed store is unreachable ({type(e).__name__}), so rank 0's host may be gone"
        dead = [r for r in before if after[r] == before[r] and r not in done]
        if dead:
            return "rank " + ", ".join(map(str, dead)) + f" stopped (no heartbeat for {self.probe_s:.1f} s)"
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
            raise TransferError(f"transport torch with backend nccl needs CUDA tensors, these are on {device}")
        if backend == "gloo" and device.type != "cpu":
            raise TransferError(f"transport torch with backend gloo moves CPU tensors; these are on {device} (use nccl)")
        return
    if transport == "uccl":
        from distlm.transfer_uccl import check_uccl

        check_uccl(device)
        return
    raise TransferError(f"unknown transport {transport!r} ({', '.join(TRANSPORTS)})")


def _make_plane(transport: str, link: _Link, **kw):
    if transport == "torch":
        return TorchPlane(link)
    from distlm.transfer_uccl import UcclPlane

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
        raise TransferError("broadcast_state_dict needs an initialised torch.distributed process group")
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
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
        plan = make_plan(tensors, bucket_mb=opts.bucket_mb, chunk_mb=opts.chunk_mb) if is_src else None
        plan, dest, staged = _exchange_metadata(link, plan, tensors, chain, rank, device)
        t_meta = time.perf_counter() - t0
        nbuf = min(2, plan.buckets)
        size = min(plan.bucket_bytes, plan.stream_bytes)
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(nbuf)]
        plane = _make_plane(opts.transport, link, store=watch.store, prefix=prefix, rank=rank, device=device,
                            timeout_s=opts.timeout_s)
        plane.setup(buffers, prev, nxt)
        checksum = _Checksum(plan.chunk_bytes, device)
        t1 = time.perf_counter()
        if is_src:
            timing = _send(plan, dest, buffers, plane, link, checksum, nxt)
        else:
            timing = _relay(plan, dest, staged, buffers, plane, link, checksum, prev, nxt, rank, opts.fault_hook)
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
            status = json.loads(link.recv_bytes(r, "metadata check"))
            if status["problems"]:
                problems[r] = status["problems"]
        verdict = json.dumps({"problems": {str(k): v for k, v in problems.items()}}).encode()
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
    link.send_bytes(json.dumps({"problems": problems}).encode(), src, "metadata check")
    verdict = json.loads(link.recv_bytes(src, "metadata verdict"))
    _raise_problems({int(k): v for k, v in verdict["problems"].items()}, "metadata")
    dest, staged = _destination(plan, tensors, device)
    return plan, dest, staged


def _raise_problems(problems: dict[int, list[str]], what: str) -> None:
    if problems:
        lines = [p for r in sorted(problems) for p in problems[r]]
        raise TransferError(f"{what} check failed on rank {', '.join(map(str, sorted(problems)))}:\n  " + "\n  ".join(lines))


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
            staged[e.name] = t if t.is_contiguous() else torch.empty(e.shape, dtype=t.dtype, device=t.device)
    for e in plan.entries:
        if e.alias is not None:
            dest[e.name] = dest[e.alias] if template is None else template[e.name]
    return dest, staged


def _message_views(plan: Plan, b: int, flats: dict[str, torch.Tensor], buf: torch.Tensor, zero_copy: bool):
    """(the tensor a message travels in, segments to pack/unpack, byte range in the bucket)."""
    out = []
    for lo, hi, segs in plan.messages(b, zero_copy):
        if len(segs) == 1 and len(segs[0]) == 2:
            e, off = segs[0]
            out.append((flats[e.name][off : off + hi - lo], (), (lo, hi)))
        else:
            out.append((buf[lo:hi], segs, (lo, hi)))
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
        for view, segs, _ in views:
            for e, off, n, at in segs:
                view[at : at + n].copy_(flats[e.name][off : off + n])
                timing["packed_bytes"] += n
        timing["pack_seconds"] += time.perf_counter() - t
        if nxt is None:
            continue
        for c, (view, _, _) in enumerate(views):
            pending[slot].append((plane.wait, plane.isend(view, nxt, f"bucket {b} chunk {c}")))
        t = time.perf_counter()  # checksums while the chunks are on the wire
        sums = torch.empty(len(views), 2, dtype=torch.int64, device=buf.device)
        for c, (view, _, _) in enumerate(views):
            checksum(view, sums[c])
        timing["checksum_seconds"] += time.perf_counter() - t
        sums = sums.to(link.device)
        keep.append(sums)
        pending[slot].append((link.wait, link.isend(sums, nxt, f"checksums of bucket {b}")))
    for hs in pending:
        for wait, h in hs:
            wait(h)
    return timing


def _relay(plan, dest, staged, buffers, plane, link, checksum, prev, nxt, rank, hook) -> dict:
    """Receive each bucket from prev chunk by chunk, forward every chunk to nxt at once, check, unpack."""
    timing = {"checksum_seconds": 0.0, "unpack_seconds": 0.0, "packed_bytes": 0}
    flats = {name: _flat_bytes(t) for name, t in staged.items() if t.numel()}
    nb = plan.buckets
    recvs: dict[int, tuple] = {}
    forwards: list[list] = [[] for _ in buffers]
    mismatches = []

    def post(b: int) -> None:
        slot = b % len(buffers)
        for wait, h in forwards[slot]:  # the slot's previous bucket must have left before reuse
            wait(h)
        forwards[slot] = []
        views = _message_views(plan, b, flats, buffers[slot], plane.zero_copy)
        hs = [plane.irecv(view, prev, f"bucket {b} chunk {c}") for c, (view, _, _) in enumerate(views)]
        theirs = torch.empty(len(views), 2, dtype=torch.int64, device=link.device)
        recvs[b] = (views, hs, link.irecv(theirs, prev, f"checksums of bucket {b}"), theirs)

    if nb:
        post(0)
    for b in range(nb):
        slot = b % len(buffers)
        if b + 1 < nb:
            post(b + 1)
        views, hs, h_sums, theirs = recvs.pop(b)
        ours = torch.empty(len(views), 2, dtype=torch.int64, device=buffers[slot].device)
        for c, ((view, _, _), h) in enumerate(zip(views, hs)):
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
            lo, hi = views[c][2]
            base = b * plan.bucket_bytes
            mismatches.append({
                "bucket": b, "chunk": c, "bytes": [base + lo, base + hi],
                "tensors": plan.tensors_in(b, lo, hi),
            })
        t = time.perf_counter()
        for view, segs, _ in views:
            for e, off, n, at in segs:
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


def _stats(plan, opts, backend, device, rank, src, chain, seconds, t_meta, timing) -> dict:
    mism = timing.pop("mismatches", [])
    payload = plan.payload_bytes
    return {
        "rank": rank,
        "role": "sender" if rank == src else "receiver",
        "transport": opts.transport,
        "backend": backend,
        "device": str(device),
        "src": src,
        "chain": chain,
        "bytes": payload,
        "stream_bytes": plan.stream_bytes,
        "tensors": len(plan.entries),
        "tied_tensors": sum(e.alias is not None for e in plan.entries),
        "buckets": plan.buckets,
        "bucket_bytes": plan.bucket_bytes,
        "chunk_bytes": plan.chunk_bytes,
        "metadata_seconds": round(t_meta, 6),
        "seconds": round(seconds, 6),
        "gbps": round(payload / seconds / 1e9, 4) if seconds > 0 else None,
        **{k: round(v, 6) for k, v in timing.items()},
        "verified": not mism if rank != src else None,
        "mismatches": [
            f"bucket {m['bucket']} chunk {m['chunk']} (stream bytes {m['bytes'][0]}-{m['bytes'][1]}): "
            f"checksum differs from rank {src}'s; tensors {', '.join(m['tensors'])}"
            for m in mism
        ],
    }


def _finish(link: _Link, stats: dict, chain: list[int], rank: int, src: int, t1: float) -> dict:
    """Receivers report to the source; it tells all whether everyone verified. Raises if not."""
    if rank != src:
        link.send_bytes(json.dumps(stats).encode(), src, "transfer report")
        verdict = json.loads(link.recv_bytes(src, "transfer verdict"))
        stats["all_verified"] = verdict["ok"]
        if not verdict["ok"]:
            raise TransferError(verdict["error"])
        return stats
    receivers = [json.loads(link.recv_bytes(r, "transfer report")) for r in chain[1:]]
    # The sender's clock stops when the last receiver has reported: that is the broadcast time.
    seconds = time.perf_counter() - t1
    stats["seconds"] = round(seconds, 6)
    stats["gbps"] = round(stats["bytes"] / seconds / 1e9, 4) if seconds > 0 else None
    bad = [r for r in receivers if not r["verified"]]
    error = ""
    if bad:
        error = "corrupted data: " + "; ".join(f"rank {r['rank']}: {m}" for r in bad for m in r["mismatches"][:3])
    for r in chain[1:]:
        link.send_bytes(json.dumps({"ok": not bad, "error": error}).encode(), r, "transfer verdict")
    stats["receivers"] = [
        {k: r[k] for k in ("rank", "seconds", "gbps", "verified", "checksum_seconds", "unpack_seconds", "mismatches")}
        for r in receivers
    ]
    stats["verified"] = not bad
    stats["all_verified"] = not bad
    if bad:
        raise TransferError(error)
    return stats


# ----------------------------------------------------------------------------- the stage


def run_broadcast_stage(cfg: Mapping[str, Any], *, topo, model_dir, report_path) -> dict | None:
    """The broadcast stage: rank 0 loads the serialized model and sends it to every other rank.

    World = 1 sender + `broadcast.receivers`. Rank 0 writes the JSON report (atomically) after
    every receiver has verified its buckets; returns the report on rank 0, None elsewhere.
    """
    from pathlib import Path

    from distlm.io import sha256_file, write_json
    from distlm.model import META, WEIGHTS, load_safetensors, read_meta

    bcfg = cfg["broadcast"]
    opts = TransferOptions.from_config(bcfg, device=topo.device)
    model_dir = Path(model_dir)
    tensors, meta = None, {}
    if topo.is_main:
        weights = model_dir / WEIGHTS
        meta = read_meta(model_dir)
        actual = sha256_file(weights) if weights.is_file() else None
        if meta.get("model_sha256") and actual != meta["model_sha256"]:
            raise TransferError(f"{weights}: sha256 {actual} does not match {model_dir / META} ({meta['model_sha256']})")
        tensors = load_safetensors(weights, device=str(topo.device))
    expected = 1 + bcfg["receivers"]
    if topo.world_size != expected:
        raise TransferError(
            f"broadcast.receivers is {bcfg['receivers']}, so the stage needs {expected} ranks; "
            f"it was launched with {topo.world_size}"
        )
    if topo.is_main:
        log.info("sending %s: %d tensors, %.1f MB to %d receivers over %s (buckets %s MB, chunks %s MB)",
                 model_dir / WEIGHTS, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
                 bcfg["receivers"], opts.transport, opts.bucket_mb, opts.chunk_mb)
    result = broadcast_state_dict(tensors, src=0, options=opts)
    s = result.stats
    log.info("%s %.1f MB in %.3f s (%.3f GB/s), %d buckets, verified: %s",
             "sent" if topo.is_main else "received", s["bytes"] / 1e6, s["seconds"], s["gbps"] or 0.0,
             s["buckets"], s["all_verified"])
    if not topo.is_main:
        return None
    report = {
        "format": "distlm-broadcast/1",
        "model": str(model_dir),
        "model_sha256": meta.get("model_sha256"),
        "world_size": topo.world_size,
        "receivers_configured": bcfg["receivers"],
        "bucket_mb": opts.bucket_mb,
        "chunk_mb": opts.chunk_mb,
        "timeout_s": opts.timeout_s,
        "config_digest": cfg.get("_digest"),
        **s,
    }
    write_json(report_path, report)
    return report
