"""`train`: data-parallel training (distlm.train)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from distlm import DistlmError
from distlm.core.section import ONLY_WHEN_SET
from distlm.settings.base import Real, Section, StageConfig
from distlm.settings.runtime import RuntimeSettings
from distlm.settings.transfer import TransferSettings

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Parallel = Literal["ddp", "fsdp"]


class DdpSettings(Section):
    bucket_cap_mb: Real = Field(default=25, gt=0, description="DDP gradient bucket size in MiB.")
    static_graph: bool = Field(default=False, description="DDP static-graph mode.")


class FsdpSettings(Section):
    reduce_every_micro_batch: bool = Field(
        default=True,
        description=(
            "Under gradient accumulation, reduce-scatter each micro-batch's gradients into the "
            "ranks' shards (true: a rank holds its shard of the gradients alone), or keep them "
            "whole on every rank until the step's last micro-batch (false: one reduce-scatter a "
            "step, 4 bytes a parameter more on every rank). docs/parallelism.md."
        ),
    )


class ProfileSettings(Section):
    enabled: bool = Field(default=False, description="Run torch.profiler over a window of steps.")
    wait: int = Field(default=1, ge=0, description="Profiler schedule: steps skipped first.")
    warmup: int = Field(
        default=1, ge=0, description="Profiler schedule: warm-up steps, not recorded."
    )
    active: int = Field(default=3, ge=1, description="Profiler schedule: steps recorded.")
    top_ops: int = Field(default=25, ge=1, description="Operators listed in top-ops, by self time.")


class TrainSettings(Section):
    nodes: int = Field(
        default=1, ge=1, description="Nodes (under SLURM the profile's nodes decide)."
    )
    nproc_per_node: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Ranks torchrun starts per node; null = one per GPU the node has (runtime.device "
            "cuda or auto), 1 on the CPU. More ranks than GPUs are refused before any work."
        ),
    )
    max_steps: int = Field(default=60, ge=1, description="Optimizer steps.")
    micro_batch_size: int = Field(
        default=8, ge=1, description="Blocks per rank per forward/backward."
    )
    grad_accum_steps: int = Field(
        default=1,
        ge=1,
        description="Micro-batches per optimizer step; ignored when global_batch_size is set.",
    )
    lr: Real = Field(default=0.001, gt=0, description="Peak learning rate, for the global batch.")
    min_lr: Real = Field(
        default=0.0001, ge=0, description="Learning rate at the end of the cosine."
    )
    warmup_steps: int = Field(default=10, ge=0, description="Steps of the linear warmup to lr.")
    weight_decay: Real = Field(
        default=0.1, ge=0, description="AdamW weight decay (none on biases and norms)."
    )
    beta1: Real = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: Real = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: Real = Field(
        default=1.0, ge=0, description="Clip the global gradient norm to this; 0 = no clipping."
    )
    precision: Precision = Field(
        default="auto",
        description="auto = bf16 (else fp16) autocast on GPUs, fp32 on CPU; or fp32, bf16, fp16.",
    )
    compile: bool = Field(default=False, description="torch.compile the model before DDP wraps it.")
    parallel: Parallel = Field(
        default="ddp",
        **ONLY_WHEN_SET,
        description=(
            "How the ranks hold the model: ddp, a whole copy each (weights, gradients, AdamW "
            "state), gradients all-reduced; fsdp (FSDP2), each rank a shard of them, per block, "
            "checkpoints sharded (torch.distributed.checkpoint: a run resumes on any number of "
            "ranks). docs/parallelism.md."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False,
        **ONLY_WHEN_SET,
        description=(
            "Recompute each block's activations in the backward pass instead of keeping them "
            "(less memory, about a third more compute)."
        ),
    )
    fast_kernels: bool = Field(
        default=True,
        description=(
            "The device's training kernels: on the CPU the LM head fused with the "
            "cross-entropy in chunks (distlm.train.kernels); false: the standard head and loss "
            "on every device."
        ),
    )
    ckpt_every: int = Field(
        default=20, ge=1, description="Checkpoint every N steps and at the end."
    )
    keep_last: int = Field(
        default=2,
        ge=1,
        description="Checkpoints kept of this run identity (the newest that verify).",
    )
    keep_runs: int = Field(
        default=3,
        ge=1,
        description=(
            "Run identities whose checkpoints are kept (the most recently used; the current one "
            "always). An edit that changes the identity trains in a folder of its own; reverting "
            "it finds the old run's checkpoints while it is among these."
        ),
    )
    eval_every: int = Field(
        default=20, ge=1, description="Validation every N steps and at the end."
    )
    eval_batches: int = Field(
        default=4, ge=1, description="Validation batches (of micro_batch_size x world size blocks)."
    )
    log_every: int = Field(default=1, ge=1, description="A log line every N steps.")
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="torchrun --max-restarts; a restarted run resumes from the last good checkpoint.",
    )
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Blocks per optimizer step over all ranks; sets grad_accum_steps to global_batch_size"
            " / (micro_batch_size x world size), which must divide it. null: use "
            "grad_accum_steps. lr is the peak rate for this global batch."
        ),
    )
    resume: Literal["auto", "never"] = Field(
        default="auto",
        description=(
            "auto resumes from the last good checkpoint of the same run identity (a finished one "
            "is reused without a training step); never deletes that identity's checkpoints and "
            "trains afresh."
        ),
    )
    ddp: DdpSettings = Field(default=DdpSettings(), description="DistributedDataParallel options.")
    fsdp: FsdpSettings = Field(
        default=FsdpSettings(), **ONLY_WHEN_SET, description="FSDP2 options (parallel: fsdp)."
    )
    profile: ProfileSettings = Field(
        default=ProfileSettings(), description="torch.profiler over a window of steps."
    )


# ----------------------------------------------------------------------------- a step's batch


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is cut: per rank, per micro-step."""

    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.grad_accum

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.world_size


def plan_batch(train_cfg: TrainSettings, world_size: int) -> BatchPlan:
    """Derive the batch plan from config `train` and the world size; errors name the key."""
    micro = train_cfg.micro_batch_size
    gbs = train_cfg.global_batch_size
    if gbs is None:
        return BatchPlan(micro, train_cfg.grad_accum_steps, world_size)
    per_step = micro * world_size
    if gbs % per_step:
        raise DistlmError(
            f"train.global_batch_size: {gbs} is not divisible by train.micro_batch_size ({micro}) x "
            f"world size ({world_size}) = {per_step}; pick a multiple of {per_step}"
        )
    return BatchPlan(micro, gbs // per_step, world_size)


# ----------------------------------------------------------------------------- the stage's keys


class TrainConfig(StageConfig):
    STAGE: ClassVar[str] = "train"
    KIND: ClassVar[str] = "distlm-config-train"
    runtime: RuntimeSettings
    train: TrainSettings
    transfer: TransferSettings
