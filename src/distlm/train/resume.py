"""Resume: which checkpoint (or finished run to extend) a start picks, and loading it into the
run's `TrainState` (model, optimiser, schedule, scaler) after its identity
(distlm.train.identity) is checked: a whole checkpoint's files (`load_whole`) or every rank's
shards (`load_sharded`), as the run's layout loads its kind (distlm.train.parallel). The
`Trainer` calls these while it is constructed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distlm import DistlmError
from distlm.core.io import remove_leftovers
from distlm.core.log import get_logger
from distlm.runtime.dist import Topology
from distlm.settings import TrainSettings
from distlm.train import checkpoint as ckpt_mod
from distlm.train import identity as identity_mod
from distlm.train.documents import RunIdentity
from distlm.train.paths import TrainPaths
from distlm.train.state import TrainState

log = get_logger(__name__)


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint gives back beyond the tensors it loads in place."""

    step: int
    history: dict  # the metrics rows so far
    path: str
    rng_state: Any  # this rank's RNG states, set after the weights are synced (None: reseed)


def load_checkpoint(
    choice: tuple[str, int],
    state: TrainState,
    *,
    identity: RunIdentity,
    topo: Topology,
    max_steps: int,
) -> Resumed:
    """All ranks: check the checkpoint's identity, load it into `state` (the weights, AdamW's
    state, the schedule and the scaler), as the run's layout loads its kind of checkpoint."""
    ck = ckpt_mod.Checkpoint(Path(choice[0]), choice[1])
    doc = ckpt_mod.read_state(ck)
    identity_mod.check_identity(ck, doc.identity, identity)
    kind = state.layout.checkpoints
    if ckpt_mod.kind_of(ck) != kind.name:  # the identities differ (train.parallel): a guard
        raise ckpt_mod.CheckpointMismatch(
            f"{ck.path}: a {ckpt_mod.kind_of(ck)} checkpoint, and this run's layout "
            f"(train.parallel {state.layout.name}) writes {kind.name} ones"
        )
    rng_state = ckpt_mod.load_rng_state(ck, topo.rank, topo.world_size, reshards=kind.reshards)
    kind.load(ck, state, topo)
    state.load_checkpoint_state(doc)
    log.info("resuming from %s (step %d of %d)", ck.path, doc.step, max_steps)
    return Resumed(doc.step, doc.metrics, str(ck.path), rng_state)


def choose_checkpoint(
    paths: TrainPaths, tcfg: TrainSettings, identity: RunIdentity
) -> tuple[Path, tuple[str, int] | None]:
    """Rank 0: clear leftovers of killed writes, open this identity's run folder, then pick
    its newest checkpoint that verifies (or, with none, a finished run this one extends).
    `train.resume: never` removes this identity's checkpoints first, no other's.
    Returns (the run folder, the checkpoint's (path, step) or None)."""
    root = paths.checkpoints
    remove_leftovers(paths.out)
    ckpt_mod.clean_leftovers(root)
    identity_mod.migrate_legacy(root)
    run_dir = identity_mod.open_run(root, identity)
    ckpt_mod.clean_leftovers(run_dir)
    log.info("run identity %s: checkpoints in %s", run_dir.name, run_dir)
    if tcfg.resume == "never":
        log.warning("train.resume is never: removing this run's checkpoints in %s", run_dir)
        ckpt_mod.prune(run_dir, 0)
        return run_dir, None
    found = ckpt_mod.latest_good(run_dir)
    max_steps = tcfg.max_steps
    if found is None:
        found = identity_mod.extension_source(root, identity)
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


def resume_or_start(
    paths: TrainPaths,
    tcfg: TrainSettings,
    state: TrainState,
    *,
    identity: RunIdentity,
    topo: Topology,
) -> tuple[Path | None, Resumed | None]:
    """All ranks: rank 0 opens this identity's run folder and picks the checkpoint, every rank
    loads it into `state`. Returns (the run folder on rank 0, None elsewhere; what was resumed,
    or None).

    A checkpoint at step max_steps with this run's identity is finished work: it is loaded like
    any other, and `Trainer.fit` writes the final folder from it without a training step."""
    run_dir, choice = choose_checkpoint(paths, tcfg, identity) if topo.is_main else (None, None)
    box = [choice]
    if topo.is_distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return run_dir, None
    resumed = load_checkpoint(box[0], state, identity=identity, topo=topo, max_steps=tcfg.max_steps)
    return run_dir, resumed


# ----------------------------------------------------------------------------- the two kinds


def load_whole(ckpt: ckpt_mod.Checkpoint, state: TrainState, topo: Topology) -> None:
    """A whole checkpoint into `state`: its weights on rank 0 (the others get them from rank 0
    next: the layout's `start`), its optimizer state on every rank."""
    tree = {"model": ckpt_mod.load_weights(ckpt)} if topo.is_main else {}
    tree["optim"] = ckpt_mod.load_optimizer_state(ckpt, topo.device)
    files = {
        "model": str(ckpt.path / "model.safetensors"),
        "optim": str(ckpt.path / "optimizer.pt"),
    }
    state.load_state_dict(tree, where=files)


def load_sharded(ckpt: ckpt_mod.Checkpoint, state: TrainState, topo: Topology) -> None:
    """A sharded checkpoint into this rank's shards of the weights and AdamW's state, whatever the
    number of ranks that wrote it (torch.distributed.checkpoint reshards); all ranks call."""
    from torch.distributed.checkpoint.state_dict_loader import load as load_shards

    tree = state.state_dict()  # this rank's shards, which DCP loads in place
    where = ckpt.path / ckpt_mod.SHARDS
    try:
        load_shards(tree, checkpoint_id=where)
    except Exception as e:
        raise DistlmError(
            f"{where}: the sharded checkpoint does not load into this model "
            f"({type(e).__name__}: {e})"
        ) from None
    state.load_state_dict(tree)
