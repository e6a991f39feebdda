"""Run identity and resume: what a checkpoint must share with this run, which checkpoint (or
finished run to extend) a start picks, loading it into the model, optimiser and schedule, and the
check that every rank then holds the same weights. The `Trainer` calls these at set-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.dist import Topology
from distlm.io import remove_leftovers
from distlm.log import get_logger
from distlm.model import check_state_dict
from distlm.settings import TrainSettings
from distlm.settings.stage import TrainConfig
from distlm.train import checkpoint as ckpt_mod
from distlm.train.optim import weights_of
from distlm.train.paths import TrainPaths
from distlm.train.sampler import BatchPlan

log = get_logger(__name__)


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint gives back beyond the tensors it loads in place."""

    step: int
    history: dict  # the metrics rows so far
    path: str
    rng_state: Any  # this rank's RNG states, set after the weights are synced


def run_identity(
    cfg: TrainConfig,
    *,
    base_meta: dict,
    data_meta: dict,
    block_size: int,
    train_blocks: int,
    world_size: int,
    plan: BatchPlan,
    precision: str,
) -> dict:
    """What a checkpoint must share with this run to be resumed (checked key by key)."""
    t = cfg.train
    return {
        "model": {
            "arch_digest": base_meta["arch_digest"],
            "base_model_sha256": base_meta["model_sha256"],
        },
        "data": {
            "config_digest": data_meta["config_digest"],
            "block_size": block_size,
            "train_blocks": train_blocks,
            "seed": cfg.runtime.seed,
        },
        "topology": {
            "world_size": world_size,
            "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum,
            "global_batch": plan.global_batch,
        },
        "optim": {
            **{
                k: getattr(t, k)
                for k in (
                    "lr",
                    "min_lr",
                    "warmup_steps",
                    "max_steps",
                    "weight_decay",
                    "beta1",
                    "beta2",
                    "grad_clip",
                )
            },
            "precision": precision,
        },
    }


def load_checkpoint(
    choice: tuple[str, int],
    *,
    identity: dict,
    topo: Topology,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    max_steps: int,
) -> Resumed:
    """All ranks: check the checkpoint's identity, load the optimiser, schedule and scaler; rank 0
    loads the weights (the others get them from rank 0 next)."""
    ck = ckpt_mod.Checkpoint(Path(choice[0]), choice[1])
    state = ckpt_mod.read_state(ck)
    ckpt_mod.check_identity(ck, state["identity"], identity)
    rng_state = ckpt_mod.load_rng_state(ck, topo.rank, topo.world_size)
    if topo.is_main:
        with torch.no_grad():
            saved = ckpt_mod.load_weights(ck)
            current = weights_of(model)
            check_state_dict(saved, current, str(ck.path / "model.safetensors"))
            for k, v in current.items():
                v.copy_(saved[k])
    optimizer.load_state_dict(ckpt_mod.load_optimizer_state(ck, topo.device))
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    log.info("resuming from %s (step %d of %d)", ck.path, state["step"], max_steps)
    return Resumed(state["step"], state["metrics"], str(ck.path), rng_state)


def choose_checkpoint(
    paths: TrainPaths, tcfg: TrainSettings, identity: dict
) -> tuple[Path, tuple[str, int] | None]:
    """Rank 0: clear leftovers of killed writes, open this identity's run folder, then pick
    its newest checkpoint that verifies (or, with none, a finished run this one extends).
    `train.resume: never` removes this identity's checkpoints first, no other's.
    Returns (the run folder, the checkpoint's (path, step) or None)."""
    root = paths.checkpoints
    remove_leftovers(paths.out)
    ckpt_mod.clean_leftovers(root)
    ckpt_mod.migrate_legacy(root)
    run_dir = ckpt_mod.open_run(root, identity)
    ckpt_mod.clean_leftovers(run_dir)
    log.info("run identity %s: checkpoints in %s", run_dir.name, run_dir)
    if tcfg.resume == "never":
        log.warning("train.resume is never: removing this run's checkpoints in %s", run_dir)
        ckpt_mod.prune(run_dir, 0)
        return run_dir, None
    found = ckpt_mod.latest_good(run_dir)
    max_steps = tcfg.max_steps
    if found is None:
        found = ckpt_mod.extension_source(root, identity)
        if found is None:
            log.info("no checkpoint of this run yet: training from step 0")
            return run_dir, None
        log.warning(
            "extending the finished run %s (step %d) to train.max_steps %d: the learning-rate "
            "schedule continues as if it had been planned for %d steps",
            found.path.parent,
            found.step,
            max_steps,
            max_steps,
        )
    elif found.step == max_steps:
        log.info(
            "%s is this run's finished work (step %d of %d): the final folder is written "
            "from it, no training step runs",
            found.path,
            found.step,
            max_steps,
        )
    return run_dir, (str(found.path), found.step)


def check_replicas_agree(model: torch.nn.Module, topo: Topology) -> None:
    """Every rank must start from bit-identical weights: compare a fingerprint across ranks."""
    with torch.no_grad():
        fp = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        fp = torch.stack([fp, -fp]).to(topo.device)
        dist.all_reduce(fp, op=dist.ReduceOp.MAX)
    mine = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().item()
    if fp[0].item() != mine or -fp[1].item() != mine:
        raise DistlmError(
            f"rank {topo.rank}: weights differ from the other ranks after the initial broadcast"
        )
