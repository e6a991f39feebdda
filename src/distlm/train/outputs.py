"""What a training run writes: its checkpoints (rank 0 writes, every rank's RNG state gathered)
and, at the end, the final model folder with the training record in its meta.

Functions of the `Trainer` whose state they write (its methods `save_checkpoint` and
`write_final` call them)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distlm import __version__
from distlm.log import get_logger
from distlm.model import DTYPES, write_model_dir
from distlm.train import checkpoint as ckpt_mod
from distlm.train.optim import weights_of

if TYPE_CHECKING:
    from distlm.train.trainer import Trainer

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


def save_checkpoint(tr: Trainer) -> None:
    """All ranks call: RNG states are gathered to rank 0, which writes the checkpoint."""
    rng = ckpt_mod.rng_state(tr.device)
    gathered: list[Any] | None = [None] * tr.topo.world_size if tr.topo.is_main else None
    dist.gather_object(rng, gathered, dst=0)
    if gathered is not None:  # rank 0
        t0 = time.perf_counter()
        state = {
            "identity": tr.identity(),
            "data": {
                "samples_consumed": tr.step * tr.plan.global_batch,
                "epoch": tr.sampler.epoch_of(tr.step),
                "sampler": tr.sampler.state(),
            },
            "scheduler": tr.scheduler.state_dict(),
            "scaler": tr.scaler.state_dict() if tr.scaler.is_enabled() else {},
            "metrics": tr.metrics.history(),
            "distlm_version": __version__,
        }
        assert tr.run_dir is not None  # rank 0 opened it in _choose_checkpoint
        path = ckpt_mod.save_checkpoint(
            tr.run_dir,
            tr.step,
            weights={k: v.detach().cpu() for k, v in weights_of(tr.model).items()},
            optimizer_state=tr.optimizer.state_dict(),
            rng_states=gathered,
            state=state,
            keep_last=tr.tcfg.keep_last,
        )
        log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
        metrics_io(tr.metrics.flush)
    tr.topo.barrier()


def write_final(tr: Trainer, wall_s: float, *, steps_run: int | None = None) -> dict | None:
    """Rank 0 writes the final model folder, in the layout of the serialized base model
    (atomically: every file fsynced, then the folder renamed into place)."""
    meta = None
    if tr.topo.is_main:
        dtype_name = tr.base_meta.get("dtype", "float32")
        sd = {
            k: v.detach().to("cpu", DTYPES[dtype_name]).contiguous()
            for k, v in weights_of(tr.model).items()
        }
        last = tr.metrics.train_rows[-1] if tr.metrics.train_rows else {}
        lastval = tr.metrics.val_rows[-1] if tr.metrics.val_rows else {}
        training = {
            "steps": tr.step,
            "tokens": tr.step * tr.tokens_per_step,
            "world_size": tr.topo.world_size,
            "global_batch": tr.plan.global_batch,
            "micro_batch": tr.plan.micro_batch,
            "grad_accum": tr.plan.grad_accum,
            "block_size": tr.block_size,
            "precision": tr.precision,
            "device": tr.device.type,
            "backend": tr.topo.backend,
            "train_loss": last.get("loss"),
            "val_loss": lastval.get("val_loss"),
            "val_perplexity": lastval.get("val_perplexity"),
            "resumed_from": tr.resumed_from,
            "steps_this_run": tr.step if steps_run is None else steps_run,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "wall_s": wall_s,
            "settings": tr.tcfg.model_dump(exclude={"profile", "fault"}),
        }
        meta = write_model_dir(
            tr.paths.final,
            state_dict=sd,
            config=tr.model_config,
            tokenizer_dir=tr.paths.tokenizer,
            meta={
                "created_by": "train",
                "source": {
                    "kind": "train",
                    "base_model": str(tr.paths.model),
                    "base_model_sha256": tr.base_meta["model_sha256"],
                },
                "config_digest": tr.cfg.digest,
                "data_config_digest": tr.data_meta["config_digest"],
                "dtype": dtype_name,
                "training": training,
            },
        )
    tr.topo.barrier()
    return meta
