"""The weight-broadcast stage (rule broadcast): rank 0 sends the serialized model to every other
rank through distlm.transfer, every receiver verifies, rank 0 writes the BroadcastReport.

    torchrun --standalone --nproc-per-node=3 -m distlm.entry.broadcast \\
        --config results/config/broadcast.json --model results/model/base \\
        --report results/broadcast/report.json --rank-log 'logs/broadcast/rank{rank}.log'
"""

from __future__ import annotations

from pathlib import Path

from distlm.documents import BroadcastReport, write_document
from distlm.log import get_logger
from distlm.model import WEIGHTS, load_safetensors, verify_model_folder
from distlm.settings.stage import BroadcastConfig
from distlm.transfer import TransferError, broadcast_state_dict

log = get_logger(__name__)


def run_broadcast_stage(
    cfg: BroadcastConfig, *, topo, model_dir: str | Path, report_path: str | Path
) -> BroadcastReport | None:
    """World = 1 sender + `broadcast.receivers`. Rank 0 writes the report (atomically) after
    every receiver has verified its buckets; returns it on rank 0, None elsewhere."""
    receivers = cfg.broadcast.receivers
    opts = cfg.transfer
    model_dir = Path(model_dir)
    tensors, meta = None, None
    weights = model_dir / WEIGHTS
    if topo.is_main:  # the one check of the folder (distlm.model.verify_model_folder)
        meta = verify_model_folder(model_dir)
        tensors = load_safetensors(weights, device=str(topo.device))
    expected = 1 + receivers
    if topo.world_size != expected:
        raise TransferError(
            f"broadcast.receivers is {receivers}, so the stage needs {expected} ranks; "
            f"it was launched with {topo.world_size}"
        )
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
    report = BroadcastReport(
        model=str(model_dir),
        model_sha256=meta.model_sha256,
        world_size=topo.world_size,
        receivers_configured=receivers,
        bucket_mb=opts.bucket_mb,
        chunk_mb=opts.chunk_mb,
        timeout_s=opts.timeout_s,
        config_digest=cfg.digest,
        stats=s,
    )
    write_document(report_path, report)
    return report
