"""What every settings section shares: the model config, the error type, the range types."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator

from distlm import DistlmError


class ConfigError(DistlmError):
    """A config key is unknown, mistyped, moved or impossible; the message names the key."""


class Section(BaseModel):
    """A section (or sub-section) of the config: unknown keys refused, values immutable, no type
    coercion (a YAML string is not a number; `distlm.settings.validate` turns command-line
    strings into the type a key asks for before validation)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _keep_int(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    checked = handler(value)
    return value if type(value) is int else checked


# A real number that stays as written: 2 stays the int 2 (a plain `float` field makes it 2.0). So a
# validated section dumps to exactly the mapping it came from, and every digest made of settings
# (stage configs, the data and model digests, the train run identity) is what it was before
# the models.
KeepInt = WrapValidator(_keep_int)
Real = Annotated[float, KeepInt]

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
