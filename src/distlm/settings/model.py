"""`model`: where the base model comes from and how it is serialized."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter

from distlm.family import DEFAULT, REGISTRY, SUPPORTED, InitSettings
from distlm.settings.base import Section, StageConfig
from distlm.settings.inference import PipelineSettings, ServePipelineSettings

# The model families distlm supports (distlm.family.REGISTRY): config.json's model_type of a hub or
# local folder, model.init.architecture of an init.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = SUPPORTED


def _architecture(value: Any) -> str:
    """model.init's family: its `architecture`, the default family's when the config names none."""
    if isinstance(value, dict):
        return value.get("architecture", DEFAULT)
    return getattr(value, "architecture", DEFAULT)


# model.init: one family's init settings, told apart by `architecture` (a discriminated union of
# the registry's families: each refuses the keys of the others)
ModelInit = Annotated[
    Union[tuple(Annotated[s.init, Tag(s.name)] for s in REGISTRY.values())],  # noqa: UP007  # pyright: ignore
    Discriminator(_architecture),
]
_MODEL_INIT: TypeAdapter[InitSettings] = TypeAdapter(ModelInit)  # pyright: ignore[reportArgumentType]


def init_settings(**keys: Any) -> InitSettings:
    """model.init from its keys (`architecture` names the family; the default family without)."""
    return _MODEL_INIT.validate_python(keys)


class ModelSourceSettings(Section):
    """Which model: what the data stage reads (a hub or local model brings its tokenizer)."""

    source: Literal["init", "hub", "local"] = Field(
        default="init",
        description=(
            "init (a seeded random model of model.init), hub (a model id in name) or local (a "
            "folder); of a supported type (distlm.family: " + ", ".join(SUPPORTED) + ")."
        ),
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
    init: ModelInit = Field(  # pyright: ignore[reportInvalidTypeForm]
        default_factory=init_settings,
        description=(
            "Architecture of a seeded random init (source init): `architecture` names the "
            "family (" + ", ".join(f"{s.name}: {s.description}" for s in REGISTRY.values()) + "), "
            "the other keys are that family's."
        ),
    )


# ----------------------------------------------------------------------------- the stage's keys


class ModelConfig(StageConfig):
    STAGE: ClassVar[str] = "model"
    KIND: ClassVar[str] = "distlm-config-model"
    model: ModelSettings


class ShardConfig(StageConfig):
    STAGE: ClassVar[str] = "shard"
    KIND: ClassVar[str] = "distlm-config-shard"
    inference: PipelineSettings

    @property
    def stages(self) -> int:
        """The pipeline's stage count: one shard per stage."""
        return self.inference.stages


class ServeShardConfig(StageConfig):
    STAGE: ClassVar[str] = "serve_shard"
    KIND: ClassVar[str] = "distlm-config-serve-shard"
    serve: ServePipelineSettings

    @property
    def stages(self) -> int:
        """The served pipeline's stage count: one shard per stage."""
        return self.serve.stages
