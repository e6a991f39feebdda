"""`model`: where the base model comes from and how it is serialized."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.settings.base import Real, Section


class ModelInitSettings(Section):
    """GPT-2 architecture for a seeded random init (source init)."""

    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads; must divide n_embd.")
    n_embd: int = Field(128, ge=8, description="Width of the residual stream.")
    n_positions: int = Field(256, ge=8, description="Context length (positions).")
    dropout: Real = Field(0.0, ge=0, le=1, description="Residual, embedding and attention dropout.")
    seed: int = Field(
        0, ge=0, description="Seed of the initial weights: the same seed, the same bits."
    )


class ModelSettings(Section):
    source: Literal["init", "hub", "local"] = Field(
        "init",
        description="init (seeded random GPT-2), hub (a model id in name) or local (a folder).",
    )
    name: str | None = Field(
        None, description="Hub id (source hub) or model folder (source local)."
    )
    revision: str | None = Field(None, description="Revision of a hub model; null = latest.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the serialized weights."
    )
    init: ModelInitSettings = Field(
        ModelInitSettings(),
        description="GPT-2 architecture for a seeded random init (source init).",
    )
