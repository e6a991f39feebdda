"""A config section as a pydantic model: unknown keys refused, values immutable, no coercion, keys
dumped in the order the config gave them. The settings (`distlm.settings`) and the model families'
init settings (`distlm.family`) are made of these.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_serializer,
    model_validator,
)


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
        """The mapping this section dumps to: without its ONLY_WHEN_SET keys at their defaults.
        (The families' init settings drop theirs by their own rule.)"""
        fields = type(self).model_fields

        def default(k: str) -> Any:  # as dumped: a sub-section's is its mapping
            d = fields[k].default
            return d.model_dump() if isinstance(d, BaseModel) else d

        return {
            k: v
            for k, v in out.items()
            if not (
                k in fields
                and fields[k].json_schema_extra is _no_schema_default
                and v == default(k)
            )
        }


def _no_schema_default(schema: dict[str, Any]) -> None:
    # no default in the generated schema: the workflow's config would hold a key that the
    # section dumps as absent (tests/test_settings.py)
    schema.pop("default", None)


# A key newer than the configs that never set it: its section dumps it only when it differs from
# its default, so the mapping of a config without it (a stage's params, every digest made of
# them) is what it was before the key existed, and an upgrade reruns nothing.
ONLY_WHEN_SET: dict[str, Any] = {"json_schema_extra": _no_schema_default}


def _keep_int(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    checked = handler(value)
    return value if type(value) is int else checked


# A real number that stays as written: 2 stays the int 2 (a plain `float` field makes it 2.0). So a
# validated section dumps to exactly the mapping it came from, and every digest made of settings
# (stage configs, the data and model digests, the train run identity) is what it was before
# the models.
KeepInt = WrapValidator(_keep_int)
Real = Annotated[float, KeepInt]
