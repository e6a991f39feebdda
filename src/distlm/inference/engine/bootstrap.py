"""Starting a pipeline: one MPI rank per stage, its share of the host's threads, its shard loaded.

    mpiexec -n 3 python -m distlm.entry.infer --config results/config/inference.json \
        --model results/train/final --prompts config/prompts.txt \
        --generations results/inference/generations.jsonl --timing results/inference/timing.json

Hidden states flow stage -> stage + 1 (ring.py); the last stage picks each sequence's next token
(sampler.py) and sends the tokens back to stage 0, whose scheduler (scheduler.py) decides whether
the sequence goes round again (decode) or finishes; stages 1..S-1 run worker.worker_loop.

Every wait has a deadline: a rank that dies or hangs makes the others stop with an error that names
the stage they were waiting for (then MPI_Abort), never a hang. Stage 0 waits `inference.timeout_s`
for tokens to come back, the other stages twice that for their next message, so stage 0 (and in
serve mode the engine, which tells the API server to answer 503) is the first to notice. While the
pipeline is idle (serve mode) stage 0 sends an empty micro-batch round the ring as a heartbeat.

MPI errors are returned, not fatal (MPI_ERRORS_RETURN), and become PipelineErrors naming both stages.
A rank killed outright ends the whole job (the launcher kills the rest); in serve mode the API
server outside the job (`distlm.inference.server.app`) then answers 503.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlm import DistlmError
from distlm.core.log import flush_to_reader, get_logger
from distlm.inference.engine.pipeline_stage import StageModel, load_stage
from distlm.inference.engine.ring import PipelineError, Ring
from distlm.inference.engine.scheduler import Scheduler
from distlm.inference.engine.worker import worker_loop
from distlm.inference.stats import StageInfo, StageStats
from distlm.runtime.dist import MPI_RING, Topology
from distlm.settings import EngineSettings

log = get_logger(__name__)


@dataclass
class Pipeline:
    """This rank's part of a running pipeline (stage 0 gets the scheduler and the tokenizer)."""

    topo: Topology  # backend MPI_RING: a rank of the ring
    model: StageModel
    ring: Ring | None
    stats: StageStats
    scheduler: Scheduler | None = None
    tokenizer: Any = None  # a transformers tokenizer
    context: int = 0
    eos_token_id: int | None = None
    infos: list[StageInfo] = field(default_factory=list)
    weights: str = ""  # the served weights' digest (the shard manifest's model_sha256 at start)
    tied: dict[str, str] = field(default_factory=dict)  # a tied copy -> its source (manifest's)
    tensors: set[str] = field(default_factory=set)  # every stage's tensors (the manifest's)

    @property
    def stage0(self) -> Scheduler:
        """Stage 0's scheduler (the other stages have none)."""
        if self.scheduler is None:
            raise PipelineError(f"stage {self.topo.rank}: only stage 0 has a scheduler")
        return self.scheduler


def host_ranks(comm) -> tuple[int, int]:
    """(this rank's index among the ranks on its host, how many ranks share the host)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


@contextlib.contextmanager
def mpi_pipeline(
    settings: EngineSettings,
    model_dir: str | Path,
    *,
    device: str = "cpu",
    api_servers: int = 0,
) -> Iterator[Pipeline]:
    """Start this rank's stage; on any error log it and MPI_Abort, so no rank waits for ever.

    `device` is runtime.device: cpu, cuda (one GPU per rank on a host) or auto; never a fallback.
    `api_servers`: serve mode's API server processes (0: batch inference). They run beside
    stage 0 and keep no thread of the budget: the ranks on a host share all of it
    (`Topology.share_threads`; why: docs/serving.md, "Stage count").
    """
    from distlm.runtime.device import DeviceBackend
    from distlm.runtime.heap import freeze_startup_heap
    from distlm.runtime.lifeline import bind_to_launcher
    from distlm.runtime.mpi_init import MPILaunchError, init_mpi

    try:
        # not `from mpi4py import MPI`: MPI_Init's failures are C aborts, so the launch is checked
        # first (under srun --mpi=pmi2 it also selects mpich's OFI netmod: issue #42)
        MPI = init_mpi()
    except MPILaunchError as e:
        log.error("%s", e)
        flush_to_reader()
        sys.exit(1)
    bind_to_launcher()  # this rank dies with mpiexec's proxy (or srun's step), batch or serve
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, stages = comm.Get_rank(), comm.Get_size()
    try:
        local_rank, local_size = host_ranks(comm)
        hw = DeviceBackend.for_rank(
            device,
            local_rank=local_rank,
            local_ranks=local_size,
            ranks_key="serve.stages" if api_servers else "inference.stages",
            share_gpus=True,  # stages talk over MPI: more stages than GPUs take them in turn
            graphs=settings.cuda_graphs,
            steps_in_flight=settings.steps_in_flight,
        )
        topo = Topology(rank, stages, local_rank, MPI_RING, hw, local_world_size=local_size)
        topo.share_threads()
        stats = StageStats(stage=rank)
        log.info("pipeline stage %d of %d: %s", rank, stages, hw.describe())
        model = load_stage(model_dir, rank, world=stages, hw=hw)
        # Stage 0 gives up first (its engine tells the API server, which answers 503); the
        # other stages wait twice as long, so they also end when stage 0 itself dies or hangs.
        wait_s = settings.timeout_s * (1 if topo.is_main else 2)
        ring = Ring(comm, topo, timeout_s=wait_s, stats=stats) if topo.is_distributed else None
        pipe = Pipeline(topo, model, ring, stats)
        if topo.is_main:
            from distlm.data import load_tokenizer
            from distlm.model import read_manifest

            pipe.tokenizer = load_tokenizer(model_dir)
            manifest = read_manifest(model_dir)
            pipe.weights, pipe.tied = manifest.model_sha256, dict(manifest.tied)
            pipe.tensors = {t for s in manifest.shards for t in s.tensors}
            pipe.context = model.context
            pipe.eos_token_id = pipe.tokenizer.eos_token_id
            pipe.scheduler = Scheduler(
                model,
                ring,
                topo,
                lanes=settings.lanes,
                eos_token_id=pipe.eos_token_id,
                context=pipe.context,
                timeout_s=settings.timeout_s,
                stats=stats,
            )
            pipe.infos = pipe.scheduler.hello()
            stats.reset()
            log.info(
                "pipeline of %d stages up: %s",
                stages,
                json.dumps([i.to_dict() for i in pipe.infos]),
            )
            log.info(
                "stage 0: micro-batches of at most %d sequences, %d in flight at once (%s)",
                pipe.scheduler.cap,
                pipe.scheduler.max_in_flight,
                "one a stage" if ring is not None else "inference.steps_in_flight",
            )
        freeze_startup_heap(f"stage {rank}")  # before the first micro-batch
        yield pipe
    except KeyboardInterrupt:
        log.warning("interrupted")
        sys.stderr.flush()
        os._exit(130)
    except BaseException as e:  # any failure must take the whole job down
        if isinstance(e, DistlmError):
            log.error("stage %d failed: %s", rank, e)
        else:
            log.exception("stage %d failed", rank)
        flush_to_reader()  # the error reaches mpiexec's output before the abort ends the job
        comm.Abort(1)


def run_workers(pipe: Pipeline) -> bool:
    """Stages 1..S-1 serve until stage 0 stops them; True when this rank is stage 0."""
    if pipe.topo.is_main:
        return True
    if pipe.ring is None:  # a later stage exists only in a ring of two or more
        raise PipelineError(f"stage {pipe.topo.rank}: no ring")
    worker_loop(pipe.model, pipe.ring, pipe.stats)
    return False
