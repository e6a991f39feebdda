"""The phases of a training rank up to its first step, as functions the `Trainer` calls in order
while it is constructed (distlm.train.trainer): `acquire_lease`, `open_data`, `read_model`,
then the layout's build (distlm.train.parallel), `resume_or_start` (distlm.train.resume) and the
layout's start (ddp: `sync_weights`). Each returns what it made; the trainer keeps it."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.data import TokenBlocks, read_tokens_meta
from distlm.data.documents import TokenMeta
from distlm.family import ModelArgs
from distlm.model import read_args, read_meta
from distlm.model.documents import ModelMeta
from distlm.runtime.dist import Topology
from distlm.runtime.lease import Lease
from distlm.settings.train import TrainConfig
from distlm.train.paths import TrainPaths
from distlm.train.step_sampler import BatchPlan, StepLoader, StepSampler, plan_batch

# The trainer's logger: the `attempt:` line keeps the name that tests and runbooks grep for.
log = get_logger("distlm.train.trainer")


def acquire_lease(paths: TrainPaths, topo: Topology) -> Lease | None:
    """Rank 0 holds the stage folder before anything is written: a second trainer for this folder
    (a rerun after Snakemake was killed while this job runs on, a second user) stops here, naming
    this one. None on the other ranks."""
    if not topo.is_main:
        return None
    lease = Lease(paths.lease, what=f"training in {paths.out}")
    lease.acquire()
    log.info(
        "attempt: host %s, pid %d, SLURM job %s, SLURM restart %s, torchrun restart %s",
        socket.gethostname(),
        os.getpid(),
        os.environ.get("SLURM_JOB_ID", "-"),
        os.environ.get("SLURM_RESTART_COUNT", "0"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    return lease


@dataclass
class TrainData:
    """The token blocks of one rank and how it walks them."""

    meta: TokenMeta
    train: TokenBlocks
    val: TokenBlocks
    plan: BatchPlan
    sampler: StepSampler
    loader: StepLoader  # step -> this rank's micro-batches on the device

    @property
    def block_size(self) -> int:
        return self.train.block_size

    @property
    def tokens_per_step(self) -> int:
        return self.plan.global_batch * self.block_size

    def close(self) -> None:
        self.loader.close()
        self.train.close()
        self.val.close()


def open_data(cfg: TrainConfig, paths: TrainPaths, topo: Topology) -> TrainData:
    """The token file's train and validation blocks, the batch plan and this rank's sampler."""
    t = cfg.train
    train = TokenBlocks(paths.tokens, "train")
    val = TokenBlocks(paths.tokens, "validation")
    meta = read_tokens_meta(paths.tokens)
    if len(train) == 0:
        raise DistlmError(f"{paths.tokens}: the train split has no blocks: nothing to train on")
    plan = plan_batch(t, topo.world_size)
    if t.nproc_per_node is not None and topo.world_size != t.nodes * t.nproc_per_node:
        log.warning(
            "world size %d differs from train.nodes x train.nproc_per_node = %d x %d (the launcher "
            "decides; the global batch is %d)",
            topo.world_size,
            t.nodes,
            t.nproc_per_node,
            plan.global_batch,
        )
    sampler = StepSampler(len(train), plan, topo.rank, cfg.runtime.seed)
    data = TrainData(
        meta, train, val, plan, sampler, StepLoader(train, sampler, topo.device_backend)
    )
    log.info(
        "data: %d train blocks of %d tokens, global batch %d blocks (%d per rank = %d micro x %d accum "
        "x %d ranks), %d tokens per step, %.2f epochs in %d steps",
        len(train),
        data.block_size,
        plan.global_batch,
        plan.per_rank,
        plan.micro_batch,
        plan.grad_accum,
        topo.world_size,
        data.tokens_per_step,
        sampler.epoch_of(t.max_steps),
        t.max_steps,
    )
    return data


def read_model(paths: TrainPaths, data: TrainData) -> tuple[ModelArgs, ModelMeta]:
    """(what distlm's model of the base folder's family is built from, the base folder's
    metadata), once the token blocks are known to fit the model; the run's layout builds it
    (distlm.train.parallel)."""
    args = read_args(paths.model)
    base = read_meta(paths.model)
    if data.block_size > args.context:
        raise DistlmError(
            f"{paths.tokens}: block size {data.block_size} is beyond the context of model "
            f"{paths.model} ({args.context} positions)"
        )
    if data.meta.vocab_size > args.vocab_size:
        raise DistlmError(
            f"{paths.tokens}: vocab size {data.meta.vocab_size} exceeds model "
            f"{paths.model}'s {args.vocab_size}"
        )
    return args, base


def sync_weights(model: torch.nn.Module, cfg: TrainConfig, topo: Topology) -> None:
    """Rank 0's weights reach every other rank through the transfer module, then are checked."""
    if not topo.is_distributed:
        return
    from distlm.transfer import broadcast_state_dict

    b = cfg.transfer
    tensors = dict(model.named_parameters())
    t0 = time.perf_counter()
    with torch.no_grad():
        result = broadcast_state_dict(tensors, src=0, settings=b)
        for k, t in result.tensors.items():
            if t is not tensors[k] and t.data_ptr() != tensors[k].data_ptr():
                tensors[k].copy_(t)
    log.info(
        "initial weights from rank 0 via the %s transport in %.2f s",
        b.transport,
        time.perf_counter() - t0,
    )
    check_replicas_agree(model, topo)


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
