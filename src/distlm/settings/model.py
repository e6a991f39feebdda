"""`model`: where the base model comes from and how it is serialized."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.settings.base import Real, Section


class ModelInitSettings(Section):
    """GPT-2 architecture for a seeded random init (source init)."""

    n_layer: int = Field(default=4, ge=1, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, description="Attention heads; must divide n_embd.")
    n_embd: int = Field(default=128, ge=8, description="Width of the residual stream.")
    n_positions: int = Field(default=256, ge=8, description="Context length (positions).")
    dropout: Real = Field(
        default=0.0, ge=0, le=1, description="Residual, embedding and attention dropout."
    )
    seed: int = Field(
        default=0, ge=0, description="Seed of the initial weights: the same seed, the same bits."
    )


class ModelSourceSettings(Section):
    """Which model: what the data stage reads (a hub or local model brings its tokenizer)."""

    source: Literal["init", "hub", "local"] = Field(
        default="init",
        description="init (seeded random GPT-2), hub (a model id in name) or local (a folder).",
    )
    name: str | None = Field(
        default=None, description="Hub id (source hub) or model folder (source local)."
    )
    revision: str | None = Field(
        default=None, description="Revision of a hub model; null = latest."
    )


class ModelSettings(ModelSourceSettings):
    """`model`: where the base model comes from and how it is serialized."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="dtype of the serialized weights."
    )
    init: ModelInitSettings = Field(
        default=ModelInitSettings(),
        description="GPT-2 architecture for a seeded random init (source init).",
    )
