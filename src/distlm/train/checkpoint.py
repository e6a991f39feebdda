"""Training checkpoints: the one save path (`save`: every rank's RNG state gathered, rank 0
writes, verifies and prunes), finding the last good one, verifying and loading it. Checkpoints
belong to a run identity, whose run folder they live in (distlm.train.identity).

A checkpoint is a folder `step-XXXXXXXX/` under its run folder, written under a hidden temporary
name and renamed when complete (a killed job never leaves one that looks finished):

    model.safetensors   the weights in transformers' names (tied lm_head.weight omitted), in the
                        training dtype
    optimizer.pt        AdamW's state in transformers' names (distlm.train.optim's
                        `named_optimizer_state`: tensors, numbers, lists; read with weights_only)
    rng.pt              every rank's RNG states, gathered to rank 0 (read with weights_only)
    state.json          a `CheckpointState` document: step, data position, scheduler and
                        gradient-scaler state, metric history, and the run identity (model,
                        data, topology, optimisation settings)
    checkpoint.json     written last: a `CheckpointIndex` document, the sha256 of every file above

A sharded run's checkpoint (`train.parallel: fsdp`: a sharded `TrainState`) holds `shards/`
in place of model.safetensors and optimizer.pt: what `torch.distributed.checkpoint` writes of
the model's and AdamW's state (distlm's parameter names), each rank its own shards into the
same folder (a shared filesystem across nodes), which loads into any number of ranks
(resharded). Rank 0 writes the rest and checkpoint.json, with the sha256 of every file, the
shards' included, and renames the folder into place once every rank has written.

Every file is fsynced before the folder is renamed into place, and the new checkpoint is verified
(read back against checkpoint.json) before older ones are pruned: only verified checkpoints count
toward keep_last, so a kill or a bad write never leaves fewer good checkpoints than before.
Leftovers of interrupted writes (`.step-*.tmp`) are removed at the next start (`clean_leftovers`).

Loading verifies checkpoint.json and every sha256; a corrupt or partial checkpoint is skipped (with
a warning naming it) for the previous good one.

Where the device backend says so (`DeviceBackend.background_checkpoints`: on a GPU, where a
checkpoint of GPT-2 small with AdamW is ~1 GB and its write stalled an H100's loop 3.9 s), rank 0
copies the checkpoint's tensors to host memory in the loop and writes them in a background thread
(`CheckpointWriter`, torchtitan's async checkpoint in spirit). The copies go to pinned buffers
kept from save to save and are queued on the device's stream; the save's closing barrier waits
for that stream, so the loop stalls for the copies at the bus's rate into pinned memory, not for
a pageable copy or the write.
The write is the same atomic one; a kill before it finishes leaves no checkpoint folder (only a
leftover the next start removes), so the run resumes from the one before, never from a partial
one. The next save, a stop and the end of the run wait for it, and its error (a full disk)
surfaces there. A sharded checkpoint follows the same policy on every rank: each copies its
shards to host memory in the loop and torch.distributed.checkpoint's `async_save` writes them
in a thread (its collectives on a gloo group of their own); rank 0's background write waits for
every rank's shards, then writes the rest and renames the folder into place.
"""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.device import CopiesDone, is_gpu
from distlm.documents import (
    CheckpointIndex,
    CheckpointState,
    DocumentError,
    RunIdentity,
    read_document,
    write_document,
)
from distlm.io import (
    atomic_dir,
    nbytes,
    remove_leftovers,
    remove_tree,
    sha256_file,
)
from distlm.log import get_logger
from distlm.model import load_safetensors, save_safetensors

if TYPE_CHECKING:
    from distlm.dist import Topology
    from distlm.train.state import TrainState

log = get_logger(__name__)

FORMAT = CheckpointIndex.tag()
_NAME = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")  # a whole checkpoint's
SHARDS = "shards"  # a sharded checkpoint's torch.distributed.checkpoint folder
SHARDED_FILES = ("rng.pt", "state.json")  # and its files beside it


class CheckpointMismatch(DistlmError):
    """A checkpoint was made by a run with a different model, data, topology or optimiser."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------- save


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time: in a background thread (`background`) or in the
    caller's. `wait` returns when the last one is on disk, raising its error if it failed.

    A background write reads host copies that `stage` makes, in buffers kept from save to save.
    With `pinned` (a GPU: distlm.device's `pin_host`) they are page-locked, and the copies are
    queued on the device's stream without waiting, as torchtitan's async checkpoint stages into
    pinned memory. `save`'s closing barrier synchronises that stream (NCCL's barrier does), so the
    loop stalls for the copies at the rate of pinned memory (tens of ms for GPT-2 small with
    AdamW, ~1.5 GB), not for a pageable copy (which stalled an H200's loop 1.36 s) or the write.
    Stream order keeps the next steps' updates behind the copies; the write waits for them before
    it reads."""

    def __init__(self, *, background: bool, pinned: bool = False) -> None:
        self._pool = ThreadPoolExecutor(1, "checkpoint") if background else None
        self._pending: Future | None = None
        self._pinned = pinned
        self._buffers: dict[tuple, torch.Tensor] = {}  # host copies by place in the tree
        self._shards: tuple[Any, Any] | None = None  # save_shards' (process group, DCP stager)
        self.write_s: list[float] = []  # each write's own seconds, in the order written

    @property
    def background(self) -> bool:
        return self._pool is not None

    def reserve(self, tree) -> None:
        """Allocate the host buffers that `stage` copies `tree` into (the shapes it will have at
        every save), in the background thread while training goes on: pinning the ~1.5 GB of
        GPT-2 small with AdamW takes a while, which the first save would otherwise stall for (it
        holds the CUDA driver's lock, so the steps meanwhile may be slower: a one-time cost of the
        early steps). Nothing without a background thread or once the buffers exist."""
        if self._pool is None or self._buffers:
            return
        specs: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self._walk(tree, (), lambda where, t: specs.setdefault(where, (t.shape, t.dtype)))
        self.wait()
        self._pending = self._pool.submit(self._allocate, specs)

    def _allocate(self, specs: dict[tuple, tuple[torch.Size, torch.dtype]]) -> None:
        for where, (shape, dtype) in specs.items():
            self._buffers[where] = torch.empty(shape, dtype=dtype, pin_memory=self._pinned)

    def stage(self, tree):
        """`tree` (state dicts, optimizer states: dicts, lists and tuples of tensors and numbers)
        with its tensors copied into this writer's host buffers, once the last write is done
        with them: what a background write reads while training goes on changing the originals.
        Returns (the copy, the event the copies end at: None when they are done already)."""
        self.wait()
        copy = self._copy(tree, ())
        if not self._pinned:
            return copy, None
        return copy, CopiesDone()  # after the copies, on the stream that queued them

    def _copy(self, tree, where: tuple):
        def copy(where: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = self._buffers.get(where)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pinned)
                self._buffers[where] = buf
            return buf.copy_(t.detach(), non_blocking=self._pinned)

        return self._walk(tree, where, copy)

    @classmethod
    def _walk(cls, tree, where: tuple, fn):
        """`tree` with fn(place, tensor) in place of each tensor (dicts, lists, tuples kept)."""
        if isinstance(tree, torch.Tensor):
            return fn(where, tree)
        if isinstance(tree, dict):
            return {k: cls._walk(v, (*where, k), fn) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(cls._walk(v, (*where, i), fn) for i, v in enumerate(tree))
        return tree

    def save_shards(self, tree, where: Path) -> Future:
        """Every rank: its shards of `tree` (DTensors' local parts) copied to host memory here
        (pinned where `pinned`, into buffers DCP's stager keeps from save to save), then written
        into `where` by torch.distributed.checkpoint's `async_save` in a thread of its own,
        whose future ends once every rank's shards and the metadata are on disk. Its collectives
        go through a gloo group of their own, made at the first call (all ranks call in step):
        NCCL's cannot run in a thread beside the training's, as torchtitan's async checkpoint
        does it. Waited on where this writer writes here and now (not `background`)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save

        self.wait()  # the previous save's shards: their host buffers are the stager's again
        if self._shards is None:
            options = StagingOptions(
                use_pinned_memory=self._pinned,
                use_shared_memory=False,
                use_async_staging=False,  # copied here: the loop changes the originals next
                use_non_blocking_copy=False,
            )
            self._shards = (dist.new_group(backend="gloo"), DefaultStager(options))
        group, stager = self._shards
        written = async_save(tree, checkpoint_id=where, process_group=group, async_stager=stager)
        assert isinstance(written, Future)  # staged here (not use_async_staging)
        return written

    def submit(self, write, *args, ready: CopiesDone | None = None, **kwargs) -> Path | None:
        """Write after the previous write (and, in the background, after `ready`: the staged
        copies); the path when written here, None when in the background (`wait` gives it)."""
        self.wait()
        if self._pool is None:
            return write(*args, **kwargs)
        self._pending = self._pool.submit(self._when_ready, ready, write, *args, **kwargs)
        return None

    @staticmethod
    def _when_ready(ready: CopiesDone | None, write, *args, **kwargs):
        if ready is not None:
            ready.synchronize()
        return write(*args, **kwargs)

    def settle(self) -> float:
        """Wait for the last write to be on disk (its error is raised); the seconds waited."""
        t0 = time.perf_counter()
        self.wait()
        return time.perf_counter() - t0

    def wait(self) -> Path | None:
        """The last background write's path once it is on disk (None if there was none)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the last write (its error is raised), then let the thread go."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers.clear()
            if self._shards is not None:
                self._shards[1].close()


def host_copy(tree):
    """`tree` with each tensor copied to host memory, a tensor of its own (a view's copy holds
    the view alone: torch.save writes a tensor's whole storage)."""
    return CheckpointWriter._walk(
        tree, (), lambda _, t: t.detach().cpu() if is_gpu(t.device) else t.detach().clone()
    )


def save(
    run_dir: Path | None,
    step: int,
    state: TrainState,
    *,
    topo: Topology,
    identity: RunIdentity,
    history: dict,
    keep_last: int,
    writer: CheckpointWriter | None = None,
) -> Path | None:
    """The one save path; all ranks call. Every rank's RNG state is gathered to rank 0, which
    writes step `step`'s checkpoint of `state` into `run_dir` (rank 0's run folder) and keeps
    the last `keep_last`, with `writer` (None: here and now); returns its path on rank 0 once
    written here, None elsewhere and for a background write. All ranks wait for rank 0's part.
    A sharded `state` (FSDP): every rank writes its shards of the model and AdamW's state
    (`_save_sharded`)."""
    writer = writer or CheckpointWriter(background=False)
    rng = topo.device_backend.rng_state()  # this rank's RNG states (distlm.device)
    gathered: list[Any] | None = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(rng, gathered, dst=0)
    doc = None
    if gathered is not None:  # rank 0
        if run_dir is None:
            raise DistlmError("rank 0 saves a checkpoint before it opened its run folder")
        doc = state.checkpoint_state(step, identity=identity, history=history)
    if state.sharded:
        return _save_sharded(
            run_dir,
            step,
            state,
            topo=topo,
            rng=gathered,
            doc=doc,
            keep_last=keep_last,
            writer=writer,
        )
    path = None
    if gathered is not None and doc is not None:  # rank 0
        t0 = time.perf_counter()
        _settle(writer, step)  # the previous write, before its buffers are used again
        ready = None
        if writer.background:  # copies, which the training loop cannot change under the write
            tensors, ready = writer.stage(state.state_dict())
        else:
            tensors = host_copy(state.state_dict())
        path = writer.submit(
            _timed_write,
            writer,
            run_dir,
            ready=ready,
            weights=tensors["model"],
            optimizer_state=tensors["optim"],
            rng_states=gathered,
            state=doc,
            keep_last=keep_last,
        )
        if path is None:
            log.info(
                "checkpoint of step %d: copies to host memory queued in %.2f s, written in the "
                "background",
                step,
                time.perf_counter() - t0,
            )
    topo.barrier()
    return path


def _settle(writer: CheckpointWriter, step: int) -> None:
    """Wait for the previous checkpoint's write; a wait the loop notices is logged."""
    waited = writer.settle()
    if waited > 0.01:
        log.warning(
            "step %d: the checkpoint waited %.2f s for the previous one's write to finish "
            "(saves come faster than the disk takes them; a larger train.ckpt_every spares "
            "the loop the wait)",
            step,
            waited,
        )


def _save_sharded(
    run_dir: Path | None,
    step: int,
    state: TrainState,
    *,
    topo: Topology,
    rng: list | None,
    doc: CheckpointState | None,
    keep_last: int,
    writer: CheckpointWriter,
) -> Path | None:
    """A sharded checkpoint (FSDP): rank 0 opens the checkpoint's temporary folder, every rank
    copies its shards of the model and AdamW's state to host memory and writes them into it
    (`CheckpointWriter.save_shards`); once every rank's are on disk, rank 0 writes the rest and
    checkpoint.json, renames the folder into place, reads it back and keeps the last
    `keep_last` (`_finish_sharded`). With a background writer the loop goes on after the copies;
    otherwise all of it happens here. A kill before the rename leaves a leftover the next start
    removes, never a checkpoint that looks finished."""
    t0 = time.perf_counter()
    _settle(writer, step)
    tree = state.state_dict()  # this rank's shards: {"model": ..., "optim": ...}
    opened = contextlib.ExitStack()  # rank 0's temporary folder, renamed by _finish_sharded
    box: list[str | None] = [None]
    if topo.is_main:
        assert run_dir is not None
        size = nbytes(tree) + nbytes(rng)  # every rank's shards: the whole state
        box[0] = str(opened.enter_context(atomic_dir(run_dir / checkpoint_name(step), size=size)))
    dist.broadcast_object_list(box, src=0)
    tmp = Path(str(box[0]))
    try:
        shards = writer.save_shards(tree, tmp / SHARDS)
    except BaseException as e:
        opened.__exit__(type(e), e, e.__traceback__)  # the temporary folder goes
        raise
    staged = time.perf_counter()
    path = None
    if not topo.is_main:
        writer.submit(shards.result)  # this rank's shards on disk
    else:
        assert doc is not None and rng is not None
        done = (shards, opened, tmp, step, rng, doc, keep_last, staged)
        path = writer.submit(_finish_sharded, writer, *done)
        if path is None:
            log.info(
                "checkpoint of step %d: shards copied to host memory in %.2f s, written in "
                "the background",
                step,
                staged - t0,
            )
    topo.barrier()
    return path


def _finish_sharded(
    writer: CheckpointWriter,
    shards: Future,
    opened: contextlib.ExitStack,
    tmp: Path,
    step: int,
    rng: list,
    state: CheckpointState,
    keep_last: int,
    started: float,
) -> Path:
    """Rank 0, once every rank's shards are on disk (`shards`, DCP's future: its metadata is
    written after every rank's data): the RNG states, state.json and checkpoint.json into the
    temporary folder, which `opened` renames into place; then read back before anything older
    goes."""
    with opened:
        shards.result()
        torch.save(rng, tmp / "rng.pt")
        write_document(tmp / "state.json", state)
        write_index(tmp, step)
    path = tmp.parent / checkpoint_name(step)
    verify(Checkpoint(path, step))
    prune(path.parent, keep_last)
    writer.write_s.append(round(time.perf_counter() - started, 4))  # from the shards' staging
    log.info("checkpoint %s written in %.2f s (sharded)", path, writer.write_s[-1])
    return path


def load_tensors(ckpt: Checkpoint, state: TrainState, topo: Topology) -> None:
    """The checkpoint's weights and AdamW's state into `state` (`TrainState.load_state_dict`);
    all ranks call. A whole checkpoint's weights load on rank 0 (the others get them from rank
    0 next), its optimizer state on every rank; a sharded one's into this rank's shards,
    whatever the number of ranks that wrote it (torch.distributed.checkpoint reshards)."""
    if not state.sharded:
        tree = {"model": load_weights(ckpt)} if topo.is_main else {}
        tree["optim"] = load_optimizer_state(ckpt, topo.device)
        files = {
            "model": str(ckpt.path / "model.safetensors"),
            "optim": str(ckpt.path / "optimizer.pt"),
        }
        state.load_state_dict(tree, where=files)
        return
    from torch.distributed.checkpoint.state_dict_loader import load as load_shards

    tree = state.state_dict()  # this rank's shards, which DCP loads in place
    try:
        load_shards(tree, checkpoint_id=ckpt.path / SHARDS)
    except Exception as e:
        raise DistlmError(
            f"{ckpt.path / SHARDS}: the sharded checkpoint does not load into this model "
            f"({type(e).__name__}: {e})"
        ) from None
    state.load_state_dict(tree)


def is_sharded(ckpt: Checkpoint) -> bool:
    """Whether a checkpoint holds shards (an FSDP run's), not whole files."""
    return (ckpt.path / SHARDS).is_dir()


def write_index(tmp: Path, step: int) -> None:
    """checkpoint.json, written last into a checkpoint's temporary folder: the sha256 of every
    file in it (a whole checkpoint's four, or a sharded one's shards and two), which a read
    checks before the folder counts as a checkpoint."""
    files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    index = CheckpointIndex(step=step, sha256={f: sha256_file(tmp / f) for f in files})
    write_document(tmp / "checkpoint.json", index)


def _timed_write(writer: CheckpointWriter, ckpt_dir: str | Path, **kw) -> Path:
    t0 = time.perf_counter()
    path = write(ckpt_dir, **kw)
    writer.write_s.append(round(time.perf_counter() - t0, 4))
    log.info("checkpoint %s written in %.2f s", path, writer.write_s[-1])
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
        write_index(tmp, step)
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
    sharded = any(f.startswith(SHARDS + "/") for f in index.sha256)
    files = sorted({*(SHARDED_FILES if sharded else FILES), *index.sha256})
    for f in files:
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


def load_rng_state(ckpt: Checkpoint, rank: int, world_size: int) -> dict | None:
    """This rank's RNG states as the checkpoint holds them; None for a sharded checkpoint made
    by another number of ranks (resharded: the data order is the same, each rank's RNG is
    seeded afresh)."""
    states = torch.load(ckpt.path / "rng.pt", weights_only=True)
    if len(states) != world_size:
        if is_sharded(ckpt):
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
