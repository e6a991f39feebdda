"""What every settings section shares: the error type and the range types; the model config of a
section (`Section`, `Real`) is `distlm.core.section`'s, which the model families' init settings share.

`StageConfig` is the typed, versioned document of the config keys one stage reads
(`distlm.dag.stages.STAGES[stage].keys`), `results/config/<stage>.json` for the multi-process stages:

    doc = read_document("results/config/train.json", TrainConfig)
    doc.train.keep_last, doc.transfer.bucket_mb, doc.digest

Each stage's class sits beside the section it is named after (`TrainConfig` in settings/train.py;
the shard stages', whose key is the pipeline's stage count, in settings/model.py with the model
stage's) and declares exactly its stage's keys, with the types of the sections they come from (a
section read in part, such as `runtime.device`, has a type of its own that the whole section's
type extends). settings/stage_configs.py holds them all by stage (`stage_keys`, `stage_params`).
tests/test_settings.py checks that every class's keys are its stage's declared keys and that each
field is the field of `Settings`, so the declarations and the types cannot drift. The rule params
stay the plain nested mapping of those keys (Snakemake's params rerun trigger); `digest` is the
digest of that mapping, which the stage's report records as `config_digest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, Field

from distlm import DistlmError
from distlm.core.documents import Document
from distlm.core.io import digest
from distlm.core.section import KeepInt, Real, Section


class ConfigError(DistlmError):
    """A config key is unknown, mistyped, moved or impossible; the message names the key."""


__all__ = [
    "MAX_SEED",
    "ConfigError",
    "KeepInt",
    "Real",
    "Section",
    "StageConfig",
    "derived_seed",
]

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


def derived_seed(seed: int, k: int) -> int:
    """The k-th seed after `seed` (a batch's k-th prompt, a request's k-th choice): seed + k,
    wrapped into 0..MAX_SEED, so every seed a config or request may give derives valid ones."""
    return (seed + k) % (MAX_SEED + 1)


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


# ----------------------------------------------------------------------------- a stage's keys


_DIGEST = Field(description="sha256 of the stage's keys as the rule's params hold them")


class StageConfig(Document):
    """The keys one stage reads, and their digest."""

    STAGE: ClassVar[str]
    VERSION: ClassVar[int] = 1
    digest: str = _DIGEST

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> Self:
        """The document of a rule's params (exactly the stage's keys, nested)."""
        return cls.model_validate({**params, "digest": digest(dict(params))})

    @classmethod
    def of_settings(cls, settings: BaseModel) -> Self:
        """The stage's part of the typed settings (distlm.settings.root.Settings): a section it
        reads whole is the settings' own, one it reads in part (a narrower type) holds those
        fields of it."""
        sections: dict[str, Any] = {}
        for name, info in cls.model_fields.items():
            if name == "digest":
                continue
            section, want = getattr(settings, name), info.annotation
            if type(section) is not want:
                assert isinstance(want, type) and issubclass(want, BaseModel), name
                section = want.model_validate({k: getattr(section, k) for k in want.model_fields})
            sections[name] = section
        doc = cls.model_validate({**sections, "digest": ""})
        return doc.model_copy(update={"digest": digest(doc.params())})

    def params(self) -> dict:
        """The stage's keys as the rule's params hold them (the mapping `digest` is of): the
        values and key order of the config they came from (distlm.settings.base.Section)."""
        return self.model_dump(exclude={"digest"})
