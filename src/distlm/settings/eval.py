"""`eval`: sliding-window perplexity of the base and the trained model."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from distlm.settings.base import Section, StageConfig
from distlm.settings.runtime import ProcessGroupSettings
from distlm.settings.train import Precision


def unique(values: list) -> list:
    """A list key's items must differ (JSON schema's uniqueItems)."""
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    if seen:
        raise ValueError(f"{seen[0]!r} is listed twice")
    return values


class EvalSettings(Section):
    """Sliding-window perplexity of the base and the trained model (config/README.md)."""

    nproc_per_node: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Ranks torchrun starts per node for each model (windows are split across them); "
            "null = one per GPU the node has (runtime.device cuda or auto), 1 on the CPU."
        ),
    )
    context: int | None = Field(
        default=None,
        ge=2,
        description="Tokens per window; null = the model's n_positions. At most n_positions.",
    )
    stride: int | None = Field(
        default=None,
        ge=1,
        description="Tokens between window starts; null = context. At most context.",
    )
    batch_size: int = Field(default=8, ge=1, description="Windows per forward pass on each rank.")
    precision: Precision = Field(
        default="auto", description="Autocast dtype; auto = bf16 (else fp16) on GPUs, fp32 on CPU."
    )
    splits: list[Literal["validation", "test"]] = Field(
        default=["validation", "test"],
        min_length=1,
        description="Splits to score.",
        json_schema_extra={"uniqueItems": True},
    )

    @field_validator("splits")
    @classmethod
    def _unique_splits(cls, v: list) -> list:
        return unique(v)


# ----------------------------------------------------------------------------- the stage's keys


class EvalConfig(StageConfig):
    STAGE: ClassVar[str] = "eval"
    KIND: ClassVar[str] = "distlm-config-eval"
    runtime: ProcessGroupSettings
    eval: EvalSettings
