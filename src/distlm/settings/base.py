"""What every settings section shares: the model config, the error type, the range types."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_serializer,
    model_validator,
)

from distlm import DistlmError


class ConfigError(DistlmError):
    """A config key is unknown, mistyped, moved or impossible; the message names the key."""


class Section(BaseModel):
    """A section (or sub-section) of the config: unknown keys refused, values immutable, no type
    coercion (a YAML string is not a number; `distlm.settings.validate` turns command-line
    strings into the type a key asks for before validation)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # The order of the keys it was given (a config file's): a section dumps its keys in that
    # order, then any others in field order, so the mapping a stage's params are dumped from is
    # the one the config held, key order included (Snakemake compares params by their repr).
    _order: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: object, handler: ModelWrapValidatorHandler[Self]) -> Self:
        section = handler(data)
        if isinstance(data, dict):
            section._order = tuple(k for k in data if k in cls.model_fields)
        return section

    def __eq__(self, other: object) -> bool:
        """Equal when of one type with equal values, whatever order the keys were given in."""
        if not isinstance(other, BaseModel):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    @model_serializer(mode="wrap")
    def _ordered(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        first = {k: out[k] for k in self._order if k in out}
        return self._dumped({**first, **{k: v for k, v in out.items() if k not in first}})

    def _dumped(self, out: dict) -> dict:
        """The mapping this section dumps to; a section whose newer keys must leave the digests of
        configs without them unchanged drops them here (ModelInitSettings)."""
        return out


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
