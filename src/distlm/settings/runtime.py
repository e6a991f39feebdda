"""`runtime`: where and how every multi-process stage runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.settings.base import Real, Section


class DeviceSettings(Section):
    """`runtime.device` alone (what a stage that starts no process group reads)."""

    device: Literal["cpu", "cuda", "auto"] = Field(
        default="cpu",
        description="cpu, cuda (one GPU per local rank), or auto (cuda when present).",
    )


class ProcessGroupSettings(DeviceSettings):
    """`runtime` without the seed: what a torch.distributed stage that draws nothing reads."""

    backend: Literal["gloo", "nccl"] = Field(
        default="gloo", description="torch.distributed backend; nccl needs device cuda."
    )
    timeout_s: Real = Field(
        default=300,
        gt=0,
        description="Collective timeout in seconds; a dead rank ends the job within it.",
    )


class RuntimeSettings(ProcessGroupSettings):
    """`runtime`: where and how every multi-process stage runs."""

    seed: int = Field(
        default=1234,
        ge=0,
        description="Seed of everything random at run time (data order, dropout).",
    )
