"""Run identity and resume: what a checkpoint must share with this run, which checkpoint (or
finished run to extend) a start picks, loading it into the model, optimiser and schedule, and the
check that every rank then holds the same weights.

Functions of the `Trainer` whose state they read and set (its methods `identity`,
`_resume_or_start`, `_choose_checkpoint` and `_check_replicas_agree` call them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.io import remove_leftovers
from distlm.log import get_logger
from distlm.model import check_state_dict
from distlm.train import checkpoint as ckpt_mod
from distlm.train.optim import weights_of

if TYPE_CHECKING:
    from distlm.train.trainer import Trainer

log = get_logger(__name__)


def run_identity(tr: Trainer) -> dict:
    """What a checkpoint must share with this run to be resumed (checked key by key)."""
    t = tr.tcfg
    return {
        "model": {
            "arch_digest": tr.base_meta["arch_digest"],
            "base_model_sha256": tr.base_meta["model_sha256"],
        },
        "data": {
            "config_digest": tr.data_meta["config_digest"],
            "block_size": tr.block_size,
            "train_blocks": len(tr.train_blocks),
            "seed": tr.cfg.runtime.seed,
        },
        "topology": {
            "world_size": tr.topo.world_size,
            "micro_batch": tr.plan.micro_batch,
            "grad_accum": tr.plan.grad_accum,
            "global_batch": tr.plan.global_batch,
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
            "precision": tr.precision,
        },
    }


def resume_or_start(tr: Trainer) -> None:
    """Find the last good checkpoint (rank 0 picks, all agree), load it, sync the weights.

    A checkpoint at step max_steps with this run's identity is finished work: it is loaded
    like any other, and `fit` writes the final folder from it without a training step.
    """
    tr._history = {}
    choice = [tr._choose_checkpoint() if tr.topo.is_main else None]
    if tr.topo.is_distributed:
        dist.broadcast_object_list(choice, src=0)
    rng_state = None
    if choice[0] is not None:
        ck = ckpt_mod.Checkpoint(Path(choice[0][0]), choice[0][1])
        state = ckpt_mod.read_state(ck)
        ckpt_mod.check_identity(ck, state["identity"], tr.identity())
        rng_state = ckpt_mod.load_rng_state(ck, tr.topo.rank, tr.topo.world_size)
        if tr.topo.is_main:
            with torch.no_grad():
                saved = ckpt_mod.load_weights(ck)
                current = weights_of(tr.model)
                check_state_dict(saved, current, str(ck.path / "model.safetensors"))
                for k, v in current.items():
                    v.copy_(saved[k])
        tr.optimizer.load_state_dict(ckpt_mod.load_optimizer_state(ck, tr.device))
        tr.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            tr.scaler.load_state_dict(state["scaler"])
        tr.step = state["step"]
        tr._history = state["metrics"]
        tr.resumed_from = str(ck.path)
        log.info("resuming from %s (step %d of %d)", ck.path, tr.step, tr.tcfg.max_steps)
    tr._sync_weights()
    if rng_state is not None:
        ckpt_mod.set_rng_state(rng_state, tr.device)
    else:
        # Different dropout masks per rank, reproducible from the config seed.
        torch.manual_seed(tr.cfg.runtime.seed + 1000 * tr.topo.rank)


def choose_checkpoint(tr: Trainer) -> tuple[str, int] | None:
    """Rank 0: clear leftovers of killed writes, open this identity's run folder, then pick
    its newest checkpoint that verifies (or, with none, a finished run this one extends).
    `train.resume: never` removes this identity's checkpoints first, no other's."""
    root = tr.paths.checkpoints
    remove_leftovers(tr.paths.out)
    ckpt_mod.clean_leftovers(root)
    ckpt_mod.migrate_legacy(root)
    identity = tr.identity()
    tr.run_dir = ckpt_mod.open_run(root, identity)
    ckpt_mod.clean_leftovers(tr.run_dir)
    log.info("run identity %s: checkpoints in %s", tr.run_dir.name, tr.run_dir)
    if tr.tcfg.resume == "never":
        log.warning("train.resume is never: removing this run's checkpoints in %s", tr.run_dir)
        ckpt_mod.prune(tr.run_dir, 0)
        return None
    found = ckpt_mod.latest_good(tr.run_dir)
    max_steps = tr.tcfg.max_steps
    if found is None:
        found = ckpt_mod.extension_source(root, identity)
        if found is None:
            log.info("no checkpoint of this run yet: training from step 0")
            return None
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
    return (str(found.path), found.step)


def check_replicas_agree(tr: Trainer) -> None:
    """Every rank must start from bit-identical weights: compare a fingerprint across ranks."""
    with torch.no_grad():
        fp = torch.stack([p.detach().double().sum() for p in tr.model.parameters()]).sum()
        fp = torch.stack([fp, -fp]).to(tr.device)
        dist.all_reduce(fp, op=dist.ReduceOp.MAX)
    mine = torch.stack([p.detach().double().sum() for p in tr.model.parameters()]).sum().item()
    if fp[0].item() != mine or -fp[1].item() != mine:
        raise DistlmError(
            f"rank {tr.topo.rank}: weights differ from the other ranks after the initial broadcast"
        )
