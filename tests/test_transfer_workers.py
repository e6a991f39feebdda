"""Multi-process helpers for tests/test_transfer.py: run a function on N gloo ranks (spawned).

No tests here: spawned children import this small module, not the test module and its fixtures.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback

import torch

from distlm.runtime.dist import distributed, free_port
from distlm.settings import TransferSettings
from distlm.transfer import TransferError, broadcast_state_dict


def _entry(fn, rank: int, world: int, port: int, q, args) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        with distributed(backend="gloo", timeout_s=60) as topo:
            q.put((rank, "ok", fn(topo, *args)))
    except Exception as e:  # reported to the test, which asserts on it
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def launch(
    fn, world: int, *args, timeout: float = 120, lost: tuple[int, ...] = ()
) -> dict[int, tuple[str, object]]:
    """Run fn(topo, *args) on `world` ranks; {rank: ("ok", value) | ("error", msg) | ("died", code)}.

    Ranks in `lost` are expected to die or freeze: nobody waits for them, and they are killed.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    awaited = set(range(world)) - set(lost)
    deadline = time.monotonic() + timeout
    try:
        while not awaited <= set(out) and time.monotonic() < deadline:
            try:
                rank, kind, value = q.get(timeout=0.5)
                out[rank] = (kind, value)
            except queue.Empty:
                if all(not procs[r].is_alive() for r in awaited - set(out)):
                    break
    finally:
        for r, p in enumerate(procs):
            if (r in lost or time.monotonic() >= deadline) and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
            if r not in out:
                out[r] = ("died", p.exitcode)
    return out


# ----------------------------------------------------------------------------- the cases


def mixed_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every awkward case at once: dtypes, zero-size, 0-d, non-contiguous, tied, > one bucket."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 257, generator=g)  # ~300 KB: spans several 64 KB buckets
    big[0, 0] = float("nan")  # bit-identical means NaN payloads too
    sd = {
        "emb.weight": big,
        "head.weight": big,  # tied: same storage, sent once
        "f16": torch.randn(33, 7, generator=g).half(),
        "bf16": torch.randn(129, generator=g).bfloat16(),
        "f64": torch.randn(5, 3, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (77,), generator=g),
        "i8": torch.randint(-128, 127, (13, 3), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8),
        "flag": torch.rand(17, generator=g) > 0.5,
        "c64": torch.randn(9, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.25),
        "transposed": torch.randn(40, 70, generator=g).t(),  # non-contiguous on the sender
        "sliced": torch.randn(64, 64, generator=g)[::2, 1:],  # non-contiguous, offset storage
    }
    return sd


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _template(sd: dict[str, torch.Tensor], *, noncontig: bool) -> dict[str, torch.Tensor]:
    t = {k: torch.zeros_like(v, memory_format=torch.contiguous_format) for k, v in sd.items()}
    t["head.weight"] = t["emb.weight"]
    if noncontig:  # a receiver whose own tensor is a non-contiguous view: filled in place too
        t["transposed"] = torch.zeros(40, 70).t()
    return t


def round_trips(topo, bucket_mb: float, chunk_mb: float) -> dict:
    """Rank 1 fills a template in place, rank 2 allocates, rank 3 has a non-contiguous template."""
    sd = mixed_state_dict()
    opts = TransferSettings(bucket_mb=bucket_mb, chunk_mb=chunk_mb, timeout_s=30)
    if topo.is_main:
        tensors = sd
    elif topo.rank == 2:
        tensors = None
    else:
        tensors = _template(sd, noncontig=topo.rank == 3)
    before = {k: v for k, v in (tensors or {}).items()}
    res = broadcast_state_dict(tensors, settings=opts)
    report = {"stats": res.stats.model_dump(), "identical": [], "in_place": True, "tied": None}
    report["identical"] = sorted(k for k in sd if same_bits(res.tensors[k], sd[k]))
    if tensors is not None and not topo.is_main:
        report["in_place"] = all(res.tensors[k] is before[k] for k in before)
        report["transposed_strides"] = list(res.tensors["transposed"].stride())
    report["tied"] = res.tensors["head.weight"].data_ptr() == res.tensors["emb.weight"].data_ptr()
    return report


def faults(topo) -> dict:
    """Several failing transfers in one process group; each must fail on every rank, cleanly."""
    g = torch.Generator().manual_seed(1)
    sd = {
        "a.weight": torch.randn(64, 64, generator=g),
        "b.bias": torch.randn(64, generator=g),
        "c.big": torch.randn(200, 200, generator=g),
    }
    opts = TransferSettings(bucket_mb=0.0625, chunk_mb=0.015625, timeout_s=30)
    out = {}

    def attempt(name, tensors, hook=None):
        try:
            broadcast_state_dict(tensors, settings=opts, fault_hook=hook)
            out[name] = "ok"
        except TransferError as e:
            out[name] = str(e)

    # 1. rank 2 expects a different shape, rank 3 a different dtype
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    if topo.rank == 2:
        tmpl["c.big"] = torch.empty(200, 201)
    if topo.rank == 3:
        tmpl["b.bias"] = torch.empty(64, dtype=torch.float16)
    attempt("mismatch", sd if topo.is_main else tmpl)
    # 2. rank 1 expects a tensor that is not sent
    tmpl = {k: torch.empty_like(v) for k, v in sd.items()}
    if topo.rank == 1:
        tmpl["extra.weight"] = torch.empty(3)
    attempt("names", sd if topo.is_main else tmpl)

    # 3. a bucket corrupted in transit at rank 2 (bucket 1, chunk 0): rank 2 and rank 3 see it
    def corrupt(rank, bucket, chunk, data):
        if rank == 2 and bucket == 1 and chunk == 0:
            data[5] ^= 0x40

    attempt(
        "corrupt",
        sd if topo.is_main else None,
        hook=corrupt,
    )
    # 4. and after all of that the group still works
    res = broadcast_state_dict(sd if topo.is_main else None, settings=opts)
    out["after"] = all(same_bits(res.tensors[k], sd[k]) for k in sd)
    # 5. nothing to send, or only zero-size tensors: no buckets, still a clean round trip
    zero = {"z": torch.empty(0), "y": torch.empty(3, 0, dtype=torch.int8)}
    empty = broadcast_state_dict({} if topo.is_main else None, settings=opts)
    zeros = broadcast_state_dict(zero if topo.is_main else None, settings=opts)
    out["empty"] = (
        empty.tensors == {}
        and empty.stats.buckets == 0
        and zeros.stats.buckets == 0
        and {k: (tuple(v.shape), v.dtype) for k, v in zeros.tensors.items()}
        == {k: (tuple(v.shape), v.dtype) for k, v in zero.items()}
    )
    return out


def dies(topo, mode: str) -> dict:
    """Rank 2 dies (exit) or freezes (SIGSTOP) in the middle of bucket 1; the others must fail."""
    sd = {f"layer{i}.weight": torch.randn(128, 128) for i in range(8)}

    def hook(rank, bucket, chunk, data):
        if rank == 2 and bucket == 1:
            if mode == "exit":
                os._exit(17)
            os.kill(os.getpid(), signal.SIGSTOP)

    opts = TransferSettings(bucket_mb=0.0625, chunk_mb=0.015625, timeout_s=6)
    t = time.monotonic()
    try:
        broadcast_state_dict(sd if topo.is_main else None, settings=opts, fault_hook=hook)
        return {"error": None, "seconds": time.monotonic() - t}
    except TransferError as e:
        return {"error": str(e), "seconds": time.monotonic() - t}


def uccl_round_trip(topo) -> dict:
    """GPU tensors over the uccl data plane (gloo carries the control messages)."""
    dev = torch.device("cuda", topo.rank)
    torch.cuda.set_device(dev)
    sd = {k: v.to(dev) for k, v in mixed_state_dict().items() if k != "head.weight"}
    opts = TransferSettings(transport="uccl", bucket_mb=0.0625, chunk_mb=0.015625, timeout_s=60)
    res = broadcast_state_dict(sd if topo.is_main else None, settings=opts, device=dev)
    return {
        "stats": res.stats.model_dump(),
        "identical": all(same_bits(res.tensors[k].cpu(), sd[k].cpu()) for k in sd),
    }
