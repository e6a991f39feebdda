"""What every settings section shares: the error type and the range types; the model config of a
section (`Section`, `Real`) is `distlm.section`'s, which the model families' init settings share."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from distlm import DistlmError
from distlm.section import KeepInt, Real, Section


class ConfigError(DistlmError):
    """A config key is unknown, mistyped, moved or impossible; the message names the key."""


__all__ = ["MAX_SEED", "ConfigError", "KeepInt", "Real", "Section"]

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed

# The sampling ranges, defined once: SamplingSettings, InferenceSettings' flat keys and every
# request model validate through these.
Temperature = Annotated[
    float,
    Field(ge=0, description="Logits are divided by it before sampling; 0 = greedy (argmax)."),
    KeepInt,
]
TopK = Annotated[
    int, Field(ge=0, description="Keep the k most likely tokens before sampling; 0 = all.")
]
TopP = Annotated[
    float,
    Field(
        gt=0,
        le=1,
        description="Keep the smallest set of tokens holding this much probability; 1 = all.",
    ),
    KeepInt,
]
Seed = Annotated[
    int,
    Field(
        ge=0,
        le=MAX_SEED,
        description="Sampling seed of a sequence (each sequence has its own generator).",
    ),
]
MaxNewTokens = Annotated[
    int, Field(ge=1, description="New tokens per sequence (fewer when end-of-text comes first).")
]
