"""What a training run writes: its checkpoints (rank 0 writes, every rank's RNG state gathered)
and, at the end, the final model folder with the training record in its meta. The `Trainer`'s
`save_checkpoint` and `write_final` call these."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlm import __version__
from distlm.dist import Topology
from distlm.log import get_logger
from distlm.model import DTYPES, write_model_dir
from distlm.settings.stage import TrainConfig
from distlm.train import checkpoint as ckpt_mod
from distlm.train.metrics import Metrics
from distlm.train.optim import weights_of
from distlm.train.paths import TrainPaths
from distlm.train.sampler import BatchPlan, StepSampler

log = get_logger(__name__)


def metrics_io(call: Callable[[], object]) -> None:
    """Write the metrics files, which are derived: the checkpoint holds their history and the
    next start writes them again. So a failure here (Snakemake removing a stopped job's
    outputs under it, a full disk) is logged and never costs the checkpoint or hides why the
    run stopped."""
    try:
        call()
    except OSError as e:
        log.warning("metrics files not written (%s); the next start writes them again", e)


def save_checkpoint(
    run_dir: Path | None,
    step: int,
    *,
    topo: Topology,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    sampler: StepSampler,
    plan: BatchPlan,
    metrics: Metrics,
    identity: Callable[[], dict],
    keep_last: int,
) -> None:
    """All ranks call: RNG states are gathered to rank 0, which writes the checkpoint."""
    rng = ckpt_mod.rng_state(topo.device)
    gathered: list[Any] | None = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(rng, gathered, dst=0)
    if gathered is not None:  # rank 0
        t0 = time.perf_counter()
        state = {
            "identity": identity(),
            "data": {
                "samples_consumed": step * plan.global_batch,
                "epoch": sampler.epoch_of(step),
                "sampler": sampler.state(),
            },
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else {},
            "metrics": metrics.history(),
            "distlm_version": __version__,
        }
        assert run_dir is not None  # rank 0 opened it in _choose_checkpoint
        path = ckpt_mod.save_checkpoint(
            run_dir,
            step,
            weights={k: v.detach().cpu() for k, v in weights_of(model).items()},
            optimizer_state=optimizer.state_dict(),
            rng_states=gathered,
            state=state,
            keep_last=keep_last,
        )
        log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
        metrics_io(metrics.flush)
    topo.barrier()


def write_final(
    paths: TrainPaths,
    cfg: TrainConfig,
    *,
    model: torch.nn.Module,
    model_config: Any,
    base_meta: dict,
    data_meta: dict,
    metrics: Metrics,
    run: dict,
    resumed_from: str | None,
    steps_run: int,
    wall_s: float,
) -> dict:
    """Rank 0 writes the final model folder, in the layout of the serialized base model
    (atomically: every file fsynced, then the folder renamed into place). `run`: the run's
    shape (steps, tokens, world size, batch, block size, precision, device, backend)."""
    dtype_name = base_meta.get("dtype", "float32")
    sd = {
        k: v.detach().to("cpu", DTYPES[dtype_name]).contiguous()
        for k, v in weights_of(model).items()
    }
    last = metrics.train_rows[-1] if metrics.train_rows else {}
    lastval = metrics.val_rows[-1] if metrics.val_rows else {}
    training = {
        **run,
        "train_loss": last.get("loss"),
        "val_loss": lastval.get("val_loss"),
        "val_perplexity": lastval.get("val_perplexity"),
        "resumed_from": resumed_from,
        "steps_this_run": steps_run,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "wall_s": wall_s,
        "settings": cfg.train.model_dump(exclude={"profile", "fault"}),
    }
    return write_model_dir(
        paths.final,
        state_dict=sd,
        config=model_config,
        tokenizer_dir=paths.tokenizer,
        meta={
            "created_by": "train",
            "source": {
                "kind": "train",
                "base_model": str(paths.model),
                "base_model_sha256": base_meta["model_sha256"],
            },
            "config_digest": cfg.digest,
            "data_config_digest": data_meta["config_digest"],
            "dtype": dtype_name,
            "training": training,
        },
    )
