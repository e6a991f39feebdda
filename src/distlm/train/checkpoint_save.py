"""The one save path of training checkpoints (`save`): all ranks call it at a step. Every rank's
RNG state is gathered to rank 0, which makes the step's `CheckpointState`; then the run's
layout saves the kind of checkpoint it writes (distlm.train.parallel's `checkpoints`, into the
format of distlm.train.checkpoint):

- `save_whole` (ddp): rank 0 writes the whole checkpoint (`checkpoint.write`), here or in the
  background writer's thread;
- `save_sharded` (fsdp): rank 0 opens the checkpoint's temporary folder, every rank writes its
  shards of the model and AdamW's state into it (torch.distributed.checkpoint), then rank 0
  writes the rest and checkpoint.json, renames the folder into place, reads it back and prunes.

Every part a rank can fail in (the previous write, the temporary folder, a rank's shards, rank
0's finish) ends with every rank agreeing on its outcome (`CheckpointWriter.agree`, over a gloo
group whose timeout is transfer.timeout_s): a failure on any rank, a full disk, fails every rank
with one error that names the rank and the file, instead of leaving the others in a collective
that the failed rank never joins.

Where the device backend says so (`DeviceBackend.background_checkpoints`: on a GPU), the
checkpoint's tensors are copied to host memory in the loop and written in a background thread
(distlm.train.checkpoint_writer, torchtitan's async checkpoint in spirit). The copies go to
pinned buffers kept from save to save and are queued on the device's stream; the save's closing
barrier waits for that stream, so the loop stalls for the copies at the bus's rate into pinned
memory, not for a pageable copy or the write. The write is the same atomic one; a kill before it
finishes leaves no checkpoint folder (only a leftover the next start removes), so the run
resumes from the one before, never from a partial one. The next save, a stop and the end of the
run wait for it, and its error (a full disk on any rank) surfaces there, on every rank. A
sharded checkpoint follows the same policy on every rank: each copies its shards to host memory
in the loop and torch.distributed.checkpoint's `async_save` writes them in a thread (its
collectives on a gloo group of their own); rank 0's background write waits for every rank's
shards, then writes the rest and renames the folder into place.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distlm import DistlmError
from distlm.core.io import atomic_dir, nbytes
from distlm.core.log import get_logger
from distlm.train import checkpoint as ckpt
from distlm.train.checkpoint_writer import CheckpointWriter, host_copy
from distlm.train.documents import CheckpointState, RunIdentity

if TYPE_CHECKING:
    from distlm.runtime.dist import Topology
    from distlm.train.state import TrainState

log = get_logger("distlm.train.checkpoint")


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
    makes step `step`'s state document; the checkpoint of `state` goes into `run_dir` (rank 0's
    run folder) as the run's layout writes it, keeping the last `keep_last`, with `writer`
    (None: here and now). Returns its path on rank 0 once written here, None elsewhere and for
    a background write."""
    writer = writer or CheckpointWriter(background=False)
    rng = topo.device_backend.rng_state()  # this rank's RNG states (distlm.runtime.device)
    gathered: list[Any] | None = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(rng, gathered, dst=0)
    doc = None
    if gathered is not None:  # rank 0
        if run_dir is None:
            raise DistlmError("rank 0 saves a checkpoint before it opened its run folder")
        doc = state.checkpoint_state(step, identity=identity, history=history)
    return state.layout.checkpoints.save(
        run_dir, step, state, topo=topo, rng=gathered, doc=doc, keep_last=keep_last, writer=writer
    )


def _settled(writer: CheckpointWriter, step: int) -> None:
    """All ranks: the previous checkpoint's write is done on every rank (its failure anywhere
    fails every rank here); a wait the loop notices is logged."""
    waited = writer.settled(f"step {step}: the checkpoint before")
    if waited > 0.01:
        log.warning(
            "step %d: the checkpoint waited %.2f s for the previous one's write to finish "
            "(saves come faster than the disk takes them; a larger train.ckpt_every spares "
            "the loop the wait)",
            step,
            waited,
        )


def save_whole(
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
    """A whole checkpoint (ddp): rank 0 copies the state to host memory and writes it (here, or
    in the background writer's thread); every rank agrees on the outcome."""
    t0 = time.perf_counter()
    _settled(writer, step)  # the previous write, before its buffers are used again
    path, error = None, None
    if topo.is_main:
        assert rng is not None and doc is not None
        try:
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
                rng_states=rng,
                state=doc,
                keep_last=keep_last,
            )
        except Exception as e:
            error = e
        if error is None and path is None:
            log.info(
                "checkpoint of step %d: copies to host memory queued in %.2f s, written in the "
                "background",
                step,
                time.perf_counter() - t0,
            )
    writer.agree(f"the checkpoint of step {step}", error)
    topo.barrier()
    return path


def _timed_write(writer: CheckpointWriter, ckpt_dir: str | Path, **kw) -> Path:
    t0 = time.perf_counter()
    path = ckpt.write(ckpt_dir, **kw)
    writer.write_s.append(round(time.perf_counter() - t0, 4))
    log.info("checkpoint %s written in %.2f s", path, writer.write_s[-1])
    return path


def save_sharded(
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
    """A sharded checkpoint (fsdp): rank 0 opens the checkpoint's temporary folder, every rank
    copies its shards of the model and AdamW's state to host memory and writes them into it
    (`CheckpointWriter.save_shards`); once every rank's are on disk, rank 0 writes the rest and
    checkpoint.json, renames the folder into place, reads it back and keeps the last `keep_last`
    (`_finish_sharded`). With a background writer the loop goes on after the copies; otherwise
    all of it happens here. A kill before the rename leaves a leftover the next start removes,
    never a checkpoint that looks finished; a failure on any rank fails every rank, naming it,
    and removes the temporary folder."""
    t0 = time.perf_counter()
    what = f"the checkpoint of step {step}"
    _settled(writer, step)
    tree = state.state_dict()  # this rank's shards: {"model": ..., "optim": ...}
    opened = contextlib.ExitStack()  # rank 0's temporary folder, renamed by _finish_sharded
    error, tmp = None, None
    if topo.is_main:
        assert run_dir is not None
        try:
            size = nbytes(tree) + nbytes(rng)  # every rank's shards: the whole state
            tmp = str(opened.enter_context(atomic_dir(ckpt_dir(run_dir, step), size=size)))
        except Exception as e:
            error = e
    with _removed_on_error(opened):
        tmp = Path(writer.agree(f"{what}: its temporary folder", error, payload=tmp)[0])
        error, shards = None, None
        try:
            shards = writer.save_shards(tree, tmp / ckpt.SHARDS)
        except Exception as e:
            error = e
        writer.agree(f"{what}: writing this rank's shards into {tmp / ckpt.SHARDS}", error)
    assert shards is not None
    staged = time.perf_counter()
    path, error = None, None
    try:
        if topo.is_main:
            assert doc is not None and rng is not None
            done = (shards, opened, tmp, step, rng, doc, keep_last, staged)
            path = writer.submit(_finish_sharded, writer, *done)
        else:
            writer.submit(shards.result)  # this rank's shards on disk
    except Exception as e:
        error = e
    writer.agree(what, error)
    if path is None and writer.background and topo.is_main:
        log.info(
            "checkpoint of step %d: shards copied to host memory in %.2f s, written in the "
            "background",
            step,
            staged - t0,
        )
    topo.barrier()
    return path


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return run_dir / ckpt.checkpoint_name(step)


@contextlib.contextmanager
def _removed_on_error(opened: contextlib.ExitStack):
    """Rank 0's temporary folder goes when a part of the save fails on any rank."""
    try:
        yield
    except BaseException as e:
        opened.__exit__(type(e), e, e.__traceback__)
        raise


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
    written after every rank's data): the rest of the checkpoint into the temporary folder,
    which `opened` renames into place; then read back before anything older goes."""
    with opened:
        shards.result()
        ckpt.finish_sharded(tmp, step, rng_states=rng, state=state)
    path = ckpt_dir(tmp.parent, step)
    ckpt.verify(ckpt.Checkpoint(path, step))
    ckpt.prune(path.parent, keep_last)
    writer.write_s.append(round(time.perf_counter() - started, 4))  # from the shards' staging
    log.info("checkpoint %s written in %.2f s (sharded)", path, writer.write_s[-1])
    return path
