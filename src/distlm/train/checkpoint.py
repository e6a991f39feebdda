"""Training checkpoints and the run identity they belong to: the one save path (`save`: every
rank's RNG state gathered, rank 0 writes, verifies and prunes), finding the last good one, the
identity (`run_identity`) and its check, run folders, pruning.

A checkpoint is a folder `step-XXXXXXXX/` under the checkpoint directory, written under a hidden
temporary name and renamed when complete (a killed job never leaves one that looks finished):

    model.safetensors   the weights (tied lm_head.weight omitted), in the training dtype
    optimizer.pt        optimizer.state_dict() (tensors, numbers, lists: read with weights_only)
    rng.pt              every rank's RNG states, gathered to rank 0 (read with weights_only)
    state.json          a `CheckpointState` document: step, data position, scheduler and
                        gradient-scaler state, metric history, and the run identity (model,
                        data, topology, optimisation settings)
    checkpoint.json     written last: a `CheckpointIndex` document, the sha256 of every file above

Every file is fsynced before the folder is renamed into place, and the new checkpoint is verified
(read back against checkpoint.json) before older ones are pruned: only verified checkpoints count
toward keep_last, so a kill or a bad write never leaves fewer good checkpoints than before.
Leftovers of interrupted writes (`.step-*.tmp`) are removed at the next start (`clean_leftovers`).

Loading verifies checkpoint.json and every sha256; a corrupt or partial checkpoint is skipped (with
a warning naming it) for the previous good one. A checkpoint whose identity differs from this run's
is refused with a message listing what differs.

Checkpoints belong to a run identity (what changes the weights: model, data, topology, optimiser
and schedule, `run_identity`): each identity has its own folder `<root>/<run id>/`, the first
16 hex digits of the identity's sha256, with `identity.json` beside its `step-*` folders. A rerun
resumes only its own identity's newest verified checkpoint; an edit that changes the identity
starts a run in another folder and deletes nothing of the others (`prune_runs` keeps the
`keep_runs` most recently used once a run has finished), so reverting an edit finds its finished
work again. The one exception: a run whose identity differs from a *finished* one only in
`max_steps` (more steps) extends it (`extension_source`), as `train.resume: auto` always has.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distlm import DistlmError, __version__
from distlm.documents import (
    CheckpointIndex,
    CheckpointState,
    DocumentError,
    ModelMeta,
    TokenMeta,
    read_document,
    write_document,
)
from distlm.io import (
    atomic_dir,
    digest,
    nbytes,
    read_json,
    remove_leftovers,
    remove_tree,
    sha256_file,
    write_json,
)
from distlm.log import get_logger
from distlm.model import load_safetensors, save_safetensors
from distlm.train.optim import weights_of

if TYPE_CHECKING:
    from distlm.dist import Topology
    from distlm.settings.stage import TrainConfig
    from distlm.train.sampler import BatchPlan, StepSampler

log = get_logger(__name__)

FORMAT = CheckpointIndex.tag()
_NAME = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")
IDENTITY = "identity.json"  # in each run folder: the identity its checkpoints belong to
LEGACY_REQUEST = "fresh-run-requested.json"  # written by distlm before run folders; removed
# Identity keys whose difference is tolerated on resume (logged): extending a run is allowed.
TOLERATED = {"optim.max_steps"}


class CheckpointMismatch(DistlmError):
    """A checkpoint was made by a run with a different model, data, topology or optimiser."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------- RNG


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (torch CPU, the CUDA device's, Python's) as weights_only-safe data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda":
        if "cuda" not in state:
            raise DistlmError("checkpoint holds no CUDA RNG state (it was made on the CPU)")
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- save


def save(
    run_dir: Path | None,
    step: int,
    *,
    topo: Topology,
    identity: dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    sampler: StepSampler,
    plan: BatchPlan,
    history: dict,
    keep_last: int,
) -> Path | None:
    """The one save path; all ranks call. Every rank's RNG state is gathered to rank 0, which
    writes step `step`'s checkpoint into `run_dir` (rank 0's run folder) and keeps the last
    `keep_last`; returns its path on rank 0, None elsewhere. All ranks wait for the write."""
    rng = rng_state(topo.device)
    gathered: list[Any] | None = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(rng, gathered, dst=0)
    path = None
    if gathered is not None:  # rank 0
        if run_dir is None:
            raise DistlmError("rank 0 saves a checkpoint before it opened its run folder")
        t0 = time.perf_counter()
        state = CheckpointState(
            identity=identity,
            data={
                "samples_consumed": step * plan.global_batch,
                "epoch": sampler.epoch_of(step),
                "sampler": sampler.state(),
            },
            scheduler=scheduler.state_dict(),
            scaler=scaler.state_dict() if scaler.is_enabled() else {},
            metrics=history,
            distlm_version=__version__,
            step=step,
        )
        path = write(
            run_dir,
            weights={k: v.detach().cpu() for k, v in weights_of(model).items()},
            optimizer_state=optimizer.state_dict(),
            rng_states=gathered,
            state=state,
            keep_last=keep_last,
        )
        log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
    topo.barrier()
    return path


def write(
    ckpt_dir: str | Path,
    *,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    rng_states: list[dict],
    state: CheckpointState,
    keep_last: int,
) -> Path:
    """Rank 0's part of `save`: write the checkpoint of `state.step` atomically, read it back,
    then keep only the last `keep_last`. A full disk raises DiskFull (distlm.io) before anything
    older is pruned."""
    ckpt_dir = Path(ckpt_dir)
    step = state.step
    final = ckpt_dir / checkpoint_name(step)
    size = nbytes(weights) + nbytes(optimizer_state) + nbytes(rng_states)
    with atomic_dir(final, size=size) as tmp:
        save_safetensors(
            weights, tmp / "model.safetensors", metadata={"format": "pt", "step": str(step)}
        )
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_states, tmp / "rng.pt")
        write_document(tmp / "state.json", state)
        index = CheckpointIndex(step=step, sha256={f: sha256_file(tmp / f) for f in FILES})
        write_document(tmp / "checkpoint.json", index)
    verify(Checkpoint(final, step))  # read back before anything older goes
    prune(ckpt_dir, keep_last)
    return final


def prune(ckpt_dir: str | Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints that verify; delete every checkpoint older than
    the oldest of them. Unverifiable ones newer than it stay (and go once older). keep_last 0
    deletes every checkpoint."""
    found = list_checkpoints(ckpt_dir)
    if keep_last > 0:
        kept = 0
        cut = None
        for c in reversed(found):
            try:
                verify(c)
            except DistlmError as e:
                log.warning("checkpoint %s does not verify (not counted as kept): %s", c.path, e)
                continue
            kept += 1
            if kept == keep_last:
                cut = c.step
                break
        if cut is None:
            return  # fewer than keep_last good checkpoints: nothing to delete
        doomed = [c for c in found if c.step < cut]
    else:
        doomed = found
    for c in doomed:
        remove_checkpoint(c)
        log.info("removed old checkpoint %s", c.path)


def remove_checkpoint(c: Checkpoint) -> None:
    """Delete a checkpoint folder as one step (distlm.io.remove_tree): a kill halfway leaves no
    folder by a checkpoint's name, only a leftover that the next start removes."""
    remove_tree(c.path)


def clean_leftovers(ckpt_dir: str | Path) -> None:
    """Remove the temporary folders of checkpoint writes whose writer is dead."""
    remove_leftovers(ckpt_dir)


# ----------------------------------------------------------------------------- run folders


def run_id(identity: dict) -> str:
    """The folder name of an identity's checkpoints."""
    return digest(identity)[:16]


def open_run(root: str | Path, identity: dict) -> Path:
    """The identity's run folder under `root`, created with its identity.json; marked as used now
    (its mtime), which is what `prune_runs` orders by."""
    run = Path(root) / run_id(identity)
    meta = run / IDENTITY
    if meta.is_file():
        saved = read_json(meta, what="run identity")
        if saved != identity:  # a digest collision, or a hand-edited file: never mix runs
            raise CheckpointMismatch(
                f"{meta} holds another identity than its folder name says:\n  "
                + "\n  ".join(identity_diff(saved, identity))
            )
        os.utime(meta)
    else:
        write_json(meta, identity)
    return run


def list_runs(root: str | Path) -> list[tuple[Path, dict]]:
    """Run folders under `root` with their identities, most recently used first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        meta = p / IDENTITY
        if p.is_dir() and not p.name.startswith(".") and meta.is_file():
            try:
                found.append((meta.stat().st_mtime, p, read_json(meta, what="run identity")))
            except (OSError, DistlmError) as e:
                log.warning("ignoring run folder %s: %s", p, e)
    return [(p, ident) for _, p, ident in sorted(found, key=lambda t: -t[0])]


def migrate_legacy(root: str | Path) -> None:
    """Move checkpoints of the layout before run folders (`<root>/step-*`) into their identity's
    folder, so an upgrade resumes (or reuses finished work) instead of training again."""
    root = Path(root)
    for c in list_checkpoints(root):
        try:
            identity = read_state(c).identity
        except DistlmError as e:
            log.warning("legacy checkpoint %s has no readable identity, left alone: %s", c.path, e)
            continue
        run = open_run(root, identity)
        os.replace(c.path, run / c.path.name)
        log.info("moved legacy checkpoint %s into its run folder %s", c.path, run)
    if (root / LEGACY_REQUEST).exists():
        log.warning(
            "ignoring %s (fresh-run requests are gone: set train.resume: never)",
            root / LEGACY_REQUEST,
        )
        (root / LEGACY_REQUEST).unlink(missing_ok=True)


def extension_source(root: str | Path, identity: dict) -> Checkpoint | None:
    """The newest finished checkpoint of another run that this one may extend: its identity
    differs only in TOLERATED keys (max_steps) and it stopped at its own max_steps, below ours."""
    target = identity["optim"]["max_steps"]
    best = None
    for run, other in list_runs(root):
        if run.name == run_id(identity) or not identity_diff(other, identity):
            continue
        if hard_diffs(other, identity):
            continue
        found = latest_good(run)
        done = other.get("optim", {}).get("max_steps")
        if found is None or found.step != done or found.step >= target:
            continue
        if best is None or found.step > best.step:
            best = found
    return best


def prune_runs(root: str | Path, keep_runs: int, current: Path) -> None:
    """Keep the `keep_runs` most recently used run folders (`current` always); delete the rest."""
    others = [run for run, _ in list_runs(root) if run.resolve() != current.resolve()]
    for run in others[max(0, keep_runs - 1) :]:
        for c in list_checkpoints(run):
            remove_checkpoint(c)
        shutil.rmtree(run, ignore_errors=True)
        log.info("removed the checkpoints of an older run %s (train.keep_runs %d)", run, keep_runs)


def list_checkpoints(ckpt_dir: str | Path) -> list[Checkpoint]:
    """Completed checkpoint folders (by name), oldest first; temporary folders are ignored."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


# ----------------------------------------------------------------------------- verify / load


# Checkpoints this process has verified, by (folder, index inode and mtime, file sizes): a folder
# is read back once after its write, not at every later prune.
_VERIFIED: set[tuple] = set()


def _fingerprint(ckpt: Checkpoint) -> tuple | None:
    try:
        st = (ckpt.path / "checkpoint.json").stat()
        sizes = tuple((ckpt.path / f).stat().st_size for f in FILES)
    except OSError:
        return None
    return (str(ckpt.path.resolve()), st.st_ino, st.st_mtime_ns, sizes)


def verify(ckpt: Checkpoint) -> None:
    """Raise DistlmError naming the file when the checkpoint is partial or corrupt."""
    key = _fingerprint(ckpt)
    if key is not None and key in _VERIFIED:
        return
    _verify(ckpt)
    if key is not None:
        _VERIFIED.add(key)


def _verify(ckpt: Checkpoint) -> None:
    index = read_document(ckpt.path / "checkpoint.json", CheckpointIndex)
    if index.step != ckpt.step:
        raise DistlmError(
            f"{ckpt.path / 'checkpoint.json'}: step {index.step}, expected {ckpt.step} "
            "(the folder's name)"
        )
    for f in FILES:
        p = ckpt.path / f
        if not p.is_file():
            raise DistlmError(f"{p}: missing from checkpoint")
        actual = sha256_file(p)
        if actual != index.sha256.get(f):
            raise DistlmError(f"{p}: sha256 {actual} does not match checkpoint.json")


def latest_good(ckpt_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; corrupt ones are skipped with a warning naming them."""
    for ckpt in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify(ckpt)
        except DistlmError as e:
            log.warning("skipping corrupt or partial checkpoint %s: %s", ckpt.path, e)
            continue
        return ckpt
    return None


def read_state(ckpt: Checkpoint) -> CheckpointState:
    """state.json of a verified checkpoint. One written before state.json carried its format tag
    (the same fields, under the same distlm-checkpoint/1 index) reads as version 1."""
    path = ckpt.path / "state.json"
    obj = read_json(path, what="checkpoint state")
    if isinstance(obj, dict) and "format" not in obj:
        obj = {"format": CheckpointState.tag(), **obj}
    try:
        return CheckpointState.from_json(obj, str(path))
    except DocumentError as e:
        raise DocumentError(
            f"{e}\nRemove {ckpt.path.parent} (or set train.resume: never) to start afresh."
        ) from None


def load_weights(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return load_safetensors(ckpt.path / "model.safetensors")


def load_optimizer_state(ckpt: Checkpoint, device: torch.device) -> dict:
    return torch.load(ckpt.path / "optimizer.pt", map_location=device, weights_only=True)


def load_rng_state(ckpt: Checkpoint, rank: int, world_size: int) -> dict:
    states = torch.load(ckpt.path / "rng.pt", weights_only=True)
    if len(states) != world_size:
        raise CheckpointMismatch(
            f"{ckpt.path}: made with world size {len(states)}, this run has {world_size}"
        )
    return states[rank]


# ----------------------------------------------------------------------------- identity


def run_identity(
    cfg: TrainConfig,
    *,
    base: ModelMeta,
    data: TokenMeta,
    block_size: int,
    train_blocks: int,
    world_size: int,
    plan: BatchPlan,
    precision: str,
) -> dict:
    """What a checkpoint must share with this run to be resumed (checked key by key), and what
    names its run folder (`run_id`): the model, data, topology and optimisation settings."""
    t = cfg.train
    return {
        "model": {
            "arch_digest": base.arch_digest,
            "base_model_sha256": base.model_sha256,
        },
        "data": {
            "config_digest": data.config_digest,
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


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def identity_diff(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ, as 'key: checkpoint X, this run Y' lines."""
    a, b = _flatten(saved), _flatten(current)
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            lines.append(
                f"{k}: checkpoint {a.get(k, '<absent>')!r}, this run {b.get(k, '<absent>')!r}"
            )
    return lines


def hard_diffs(saved: dict, current: dict) -> list[str]:
    """The identity differences that forbid a resume (all but the TOLERATED keys)."""
    return [d for d in identity_diff(saved, current) if d.split(":", 1)[0] not in TOLERATED]


def check_identity(ckpt: Checkpoint, saved: dict, current: dict) -> None:
    """Refuse a checkpoint made by a different run; tolerate (and log) only TOLERATED keys."""
    diffs = identity_diff(saved, current)
    hard = hard_diffs(saved, current)
    if hard:
        raise CheckpointMismatch(
            f"checkpoint {ckpt.path} was made by a different run and cannot be resumed:\n  "
            + "\n  ".join(hard)
            + f"\nRemove {ckpt.path.parent} (or set train.resume: never) to start afresh."
        )
    for d in diffs:
        log.warning("resuming %s with a changed setting: %s", ckpt.path, d)
