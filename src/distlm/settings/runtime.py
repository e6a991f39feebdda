"""`runtime`: where and how every multi-process stage runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.settings.base import Real, Section


class RuntimeSettings(Section):
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu",
        description="cpu, cuda (one GPU per local rank), or auto (cuda when present).",
    )
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend; nccl needs device cuda."
    )
    timeout_s: Real = Field(
        300,
        gt=0,
        description="Collective timeout in seconds; a dead rank ends the job within it.",
    )
    seed: int = Field(
        1234,
        ge=0,
        description="Seed of everything random at run time (data order, dropout).",
    )
