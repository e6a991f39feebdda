"""`transfer` (how a model's weights move between ranks: the broadcast stage and training's
initial weights) and `broadcast` (the broadcast stage's own world)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from distlm.settings.base import Real, Section, StageConfig
from distlm.settings.runtime import ProcessGroupSettings


class TransferSettings(Section):
    transport: Literal["torch", "uccl"] = Field(
        default="torch",
        description=(
            "torch (torch.distributed point-to-point: NCCL on GPUs, gloo on CPU) or uccl (UCCL "
            "P2P engine, uccl==0.1.1: GPU, Python >= 3.12, RDMA NIC or UCCL_P2P_TRANSPORT="
            "tcp|nccl); a transport that cannot run is an error, never replaced by another."
        ),
    )
    bucket_mb: Real = Field(
        default=64,
        gt=0,
        description="Flat bucket size in MiB; two buckets per rank (double buffering).",
    )
    chunk_mb: Real = Field(
        default=4,
        gt=0,
        description="Relay granularity along the chain in MiB; each chunk carries a checksum.",
    )
    timeout_s: Real = Field(
        default=120,
        gt=0,
        description="Longest wait for one message; then the job fails naming the rank that stopped.",
    )


class BroadcastSettings(Section):
    receivers: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description=(
            "Ranks that receive the model in the broadcast stage (world = 1 + receivers); null = "
            "one rank per GPU of each node, the first sending (runtime.device cuda or auto), no "
            "receiver on the CPU. With no receiver (one GPU) the stage measures the sender's own "
            "part: the weights moved from host memory to the device in buckets, each checksum "
            "compared."
        ),
    )


# ----------------------------------------------------------------------------- the stage's keys


class BroadcastConfig(StageConfig):
    STAGE: ClassVar[str] = "broadcast"
    KIND: ClassVar[str] = "distlm-config-broadcast"
    runtime: ProcessGroupSettings
    transfer: TransferSettings
    broadcast: BroadcastSettings
