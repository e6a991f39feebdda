"""The weight-broadcast stage (rule broadcast): rank 0 sends the serialized model to every other
rank through distlm.transfer, every receiver verifies, rank 0 writes the BroadcastReport.

    torchrun --standalone --nproc-per-node=3 -m distlm.entry.broadcast \\
        --config results/config/broadcast.json --model results/model/base \\
        --report results/broadcast/report.json --rank-log 'logs/broadcast/rank{rank}.log'

With no receiver (`broadcast.receivers: 0`, or null on a machine with one GPU) there is no peer
to send to: the stage measures the sender's own part of every broadcast, the weights moved from
host memory into the device in the transfer's buckets with each chunk's checksum on the device
compared with the same checksum of the host's bytes (`load_to_device`). The report then says
so: no receivers, transport `host-to-cuda` (or `host-to-cpu`), never a broadcast it was not.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from distlm.broadcast.documents import BroadcastReport
from distlm.core.documents import write_document
from distlm.core.log import get_logger
from distlm.model import WEIGHTS, load_safetensors, verify_model_folder
from distlm.runtime.device import DeviceBackend
from distlm.settings import TransferSettings
from distlm.settings.transfer import BroadcastConfig
from distlm.transfer import Checksum, TransferError, broadcast_state_dict, make_plan
from distlm.transfer.documents import TransferStats
from distlm.transfer.plan import flat_bytes

log = get_logger(__name__)


def run_broadcast_stage(
    cfg: BroadcastConfig, *, topo, model_dir: str | Path, report_path: str | Path
) -> BroadcastReport | None:
    """World = 1 sender + `broadcast.receivers` (null: the world torchrun started, one rank per
    GPU). Rank 0 writes the report (atomically) after every receiver has verified its buckets;
    returns it on rank 0, None elsewhere."""
    configured = cfg.broadcast.receivers
    receivers = topo.world_size - 1 if configured is None else configured
    opts = cfg.transfer
    model_dir = Path(model_dir)
    tensors, meta = None, None
    weights = model_dir / WEIGHTS
    if topo.is_main:  # the one check of the folder (distlm.model.verify_model_folder)
        meta = verify_model_folder(model_dir)
        host = receivers == 0  # no peer: the host-to-device move is what is measured
        tensors = load_safetensors(weights, device="cpu" if host else str(topo.device))
    if topo.world_size != 1 + receivers:
        raise TransferError(
            f"broadcast.receivers is {receivers}, so the stage needs {1 + receivers} ranks; "
            f"it was launched with {topo.world_size}"
        )
    if receivers == 0:
        assert tensors is not None and meta is not None  # a world of one: rank 0
        log.info(
            "no receivers (a world of one rank): measuring the sender's move of %s from host "
            "memory to %s in %s MB buckets, each chunk's checksum compared",
            weights,
            topo.device,
            opts.bucket_mb,
        )
        s = load_to_device(tensors, settings=opts, hw=topo.device_backend, backend=topo.backend)
        log.info(
            "moved %.1f MB to %s in %.3f s (%.3f GB/s), %d buckets, verified: %s",
            s.bytes / 1e6,
            topo.device,
            s.seconds,
            s.gbps or 0.0,
            s.buckets,
            s.all_verified,
        )
        return _report(cfg, model_dir, meta, topo.world_size, receivers, s, report_path)
    if tensors is not None:  # rank 0
        log.info(
            "sending %s: %d tensors, %.1f MB to %d receivers over %s (buckets %s MB, chunks %s MB)",
            weights,
            len(tensors),
            sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
            receivers,
            opts.transport,
            opts.bucket_mb,
            opts.chunk_mb,
        )
    s = broadcast_state_dict(tensors, settings=opts, device=topo.device).stats
    log.info(
        "%s %.1f MB in %.3f s (%.3f GB/s), %d buckets, verified: %s",
        "sent" if topo.is_main else "received",
        s.bytes / 1e6,
        s.seconds,
        s.gbps or 0.0,
        s.buckets,
        s.all_verified,
    )
    if meta is None:  # not rank 0
        return None
    return _report(cfg, model_dir, meta, topo.world_size, receivers, s, report_path)


def _report(cfg, model_dir, meta, world_size, receivers, stats, report_path) -> BroadcastReport:
    opts = cfg.transfer
    report = BroadcastReport(
        model=str(model_dir),
        model_sha256=meta.model_sha256,
        world_size=world_size,
        receivers_configured=receivers,
        bucket_mb=opts.bucket_mb,
        chunk_mb=opts.chunk_mb,
        timeout_s=opts.timeout_s,
        config_digest=cfg.digest,
        stats=stats,
    )
    write_document(report_path, report)
    return report


def load_to_device(
    tensors: dict[str, torch.Tensor],
    *,
    settings: TransferSettings,
    hw: DeviceBackend,
    backend: str,
) -> TransferStats:
    """The sender's part of a broadcast, alone: host tensors packed into the transfer's buckets
    (distlm.transfer.plan), each bucket moved to the backend's device, each chunk's checksum
    there compared with the same checksum of the host's bytes. What a world of one rank can
    measure."""
    device = hw.device
    plan = make_plan(tensors, bucket_mb=settings.bucket_mb, chunk_mb=settings.chunk_mb)
    cpu = torch.device("cpu")  # the host side: the buffer and its checksums stay there
    size = min(plan.bucket_bytes, plan.stream_bytes)
    host = torch.zeros(size, dtype=torch.uint8, pin_memory=hw.pin_host)
    there = torch.empty(size, dtype=torch.uint8, device=device)
    sum_here, sum_there = Checksum(plan.chunk_bytes, cpu), Checksum(plan.chunk_bytes, device)
    flats = {e.name: flat_bytes(tensors[e.name].contiguous()) for e in plan.entries if e.nbytes}
    pack_s = checksum_s = 0.0
    mismatches: list[str] = []
    t0 = time.perf_counter()
    for b in range(plan.buckets):
        t = time.perf_counter()
        for e, off, n, at in plan.pieces(b):
            host[at : at + n].copy_(flats[e.name][off : off + n])
        pack_s += time.perf_counter() - t
        lo, hi = plan.bucket_range(b)
        there[: hi - lo].copy_(host[: hi - lo])  # the bytes that move: host -> device
        t = time.perf_counter()
        chunks = plan.chunks(b)
        ours = torch.empty(len(chunks), 2, dtype=torch.int64, device=cpu)  # the host's sums
        theirs = torch.empty(len(chunks), 2, dtype=torch.int64, device=device)
        for c, (a, z) in enumerate(chunks):
            sum_here(host[a:z], ours[c])
            sum_there(there[a:z], theirs[c])
        bad = (theirs.cpu() != ours).any(dim=1).nonzero().flatten().tolist()
        checksum_s += time.perf_counter() - t
        mismatches += [
            f"bucket {b} chunk {c} (stream bytes {lo + chunks[c][0]}-{lo + chunks[c][1]}): "
            f"checksum on {device} differs from the host's; tensors "
            f"{', '.join(plan.tensors_in(b, *chunks[c]))}"
            for c in bad
        ]
    seconds = time.perf_counter() - t0
    return TransferStats(
        rank=0,
        role="sender",
        transport=f"host-to-{device.type}",
        backend=backend,
        device=str(device),
        src=0,
        chain=[0],
        **plan.stats_fields(seconds),
        metadata_seconds=0.0,
        pack_seconds=round(pack_s, 6),
        checksum_seconds=round(checksum_s, 6),
        packed_bytes=plan.payload_bytes,
        verified=not mismatches,
        mismatches=mismatches,
        all_verified=not mismatches,
        receivers=[],
    )
