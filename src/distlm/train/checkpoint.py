"""The format of training checkpoints: what a checkpoint folder holds, writing its files,
verifying it, finding the newest good one, pruning old ones, and reading its files back.
Checkpoints belong to a run identity, whose run folder they live in (distlm.train.identity).
The save path that writes them is distlm.train.checkpoint_save (with the background writer,
distlm.train.checkpoint_writer); a resume loads them (distlm.train.resume).

A checkpoint is a folder `step-XXXXXXXX/` under its run folder, written under a hidden temporary
name and renamed when complete (a killed job never leaves one that looks finished). It is of one
of two kinds, as the run's parallel layout writes it (distlm.train.parallel):

- **whole** (`ddp`: rank 0's files):

      model.safetensors   the weights in transformers' names (tied lm_head.weight omitted), in
                          the training dtype
      optimizer.pt        AdamW's state in transformers' names (distlm.train.state's
                          `named_optimizer_state`: tensors, numbers, lists; read with
                          weights_only)

- **sharded** (`fsdp`): `shards/` in their place, what `torch.distributed.checkpoint` writes of
  the model's and AdamW's state (distlm's parameter names), each rank its own shards into the
  same folder (a shared filesystem across nodes), which loads into any number of ranks
  (resharded);

and, either way:

    rng.pt              every rank's RNG states, gathered to rank 0 (read with weights_only)
    state.json          a `CheckpointState` document: step, data position, scheduler and
                        gradient-scaler state, metric history, and the run identity (model,
                        data, topology, optimisation settings)
    checkpoint.json     written last: a `CheckpointIndex` document, the sha256 of every file above
                        (the shards' included)

Every file is fsynced before the folder is renamed into place, and the new checkpoint is verified
(read back against checkpoint.json) before older ones are pruned: only verified checkpoints count
toward keep_last, so a kill or a bad write never leaves fewer good checkpoints than before.
Leftovers of interrupted writes (`.step-*.tmp`) are removed at the next start (`clean_leftovers`).

Loading verifies checkpoint.json and every sha256; a corrupt or partial checkpoint is skipped (with
a warning naming it) for the previous good one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.core.documents import DocumentError, read_document, write_document
from distlm.core.io import (
    atomic_dir,
    check_sha256,
    nbytes,
    remove_leftovers,
    remove_tree,
    sha256_file,
)
from distlm.core.log import get_logger
from distlm.model import load_safetensors, save_safetensors
from distlm.model.documents import CheckpointIndex
from distlm.train.documents import CheckpointState

log = get_logger(__name__)

FORMAT = CheckpointIndex.tag()
_NAME = re.compile(r"^step-(\d{8})$")
WHOLE, SHARDED = "whole", "sharded"  # the kinds of checkpoint (see the module doc)
SHARDS = "shards"  # a sharded checkpoint's torch.distributed.checkpoint folder
# the files a checkpoint of each kind holds, beyond what its index names
FILES = {
    WHOLE: ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"),
    SHARDED: ("rng.pt", "state.json"),
}


class CheckpointMismatch(DistlmError):
    """A checkpoint was made by a run with a different model, data, topology or optimiser."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def kind_of(ckpt: Checkpoint) -> str:
    """The kind of a checkpoint, from its files: SHARDED when it holds `shards/`, else WHOLE."""
    return SHARDED if (ckpt.path / SHARDS).is_dir() else WHOLE


# ----------------------------------------------------------------------------- write


def write_index(tmp: Path, step: int) -> None:
    """checkpoint.json, written last into a checkpoint's temporary folder: the sha256 of every
    file in it (a whole checkpoint's four, or a sharded one's shards and two), which a read
    checks before the folder counts as a checkpoint."""
    files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    index = CheckpointIndex(step=step, sha256={f: sha256_file(tmp / f) for f in files})
    write_document(tmp / "checkpoint.json", index)


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
    then keep only the last `keep_last`. A full disk raises DiskFull (distlm.core.io) before anything
    older is pruned."""
    ckpt_dir = Path(ckpt_dir)
    step = state.step
    final = ckpt_dir / checkpoint_name(step)
    size = nbytes(weights) + nbytes(optimizer_state) + nbytes(rng_states)
    with atomic_dir(final, size=size) as tmp:
        save_safetensors(weights, tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_states, tmp / "rng.pt")
        write_document(tmp / "state.json", state)
        write_index(tmp, step)
    verify(Checkpoint(final, step))  # read back before anything older goes
    prune(ckpt_dir, keep_last)
    return final


def finish_sharded(tmp: Path, step: int, *, rng_states: list, state: CheckpointState) -> None:
    """Rank 0's part of a sharded checkpoint, once every rank's shards are in its temporary
    folder `tmp`: the RNG states, state.json and, last, checkpoint.json (the sha256 of every
    file, the shards' included)."""
    torch.save(rng_states, tmp / "rng.pt")
    write_document(tmp / "state.json", state)
    write_index(tmp, step)


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
    """Delete a checkpoint folder as one step (distlm.core.io.remove_tree): a kill halfway leaves no
    folder by a checkpoint's name, only a leftover that the next start removes."""
    remove_tree(c.path)


def clean_leftovers(ckpt_dir: str | Path) -> None:
    """Remove the temporary folders of checkpoint writes whose writer is dead."""
    remove_leftovers(ckpt_dir)


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
        sizes = tuple(
            (str(f), f.stat().st_size) for f in sorted(ckpt.path.rglob("*")) if f.is_file()
        )
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
    kind = SHARDED if any(f.startswith(SHARDS + "/") for f in index.sha256) else WHOLE
    files = sorted({*FILES[kind], *index.sha256})
    for f in files:
        check_sha256(
            ckpt.path / f,
            index.sha256.get(f, "(none)"),
            named_by="checkpoint.json",
            missing="missing from checkpoint",
        )


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
    try:
        return read_document(ckpt.path / "state.json", CheckpointState, untagged=True)
    except DocumentError as e:
        raise DocumentError(
            f"{e}\nRemove {ckpt.path.parent} (or set train.resume: never) to start afresh."
        ) from None


def load_weights(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return load_safetensors(ckpt.path / "model.safetensors")


def load_optimizer_state(ckpt: Checkpoint, device: torch.device) -> dict:
    return torch.load(ckpt.path / "optimizer.pt", map_location=device, weights_only=True)


def load_rng_state(ckpt: Checkpoint, rank: int, world_size: int, *, reshards: bool) -> dict | None:
    """This rank's RNG states as the checkpoint holds them; None for a checkpoint of a kind that
    `reshards`, made by another number of ranks (the data order is the same, each rank's RNG is
    seeded afresh)."""
    states = torch.load(ckpt.path / "rng.pt", weights_only=True)
    if len(states) != world_size:
        if reshards:
            log.warning(
                "%s: made by %d ranks, resumed by %d: the same data order, each rank's random "
                "generators seeded afresh (dropout masks differ from an uninterrupted run's)",
                ckpt.path,
                len(states),
                world_size,
            )
            return None
        raise CheckpointMismatch(
            f"{ckpt.path}: made with world size {len(states)}, this run has {world_size}"
        )
    return states[rank]
