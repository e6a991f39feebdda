"""Stage configs: the config keys a stage reads (`distlm.stages.STAGES[stage].keys`) as a typed,
versioned document, `results/config/<stage>.json` for the multi-process stages.

    doc = read_document("results/config/train.json", TrainConfig)   # or read_stage_config
    doc.train.keep_last, doc.transfer.bucket_mb, doc.digest

Each class declares exactly its stage's keys, with the types of the sections they come from (a
section read in part, such as `runtime.device`, has a type of its own that the whole section's
type extends). tests/test_settings.py checks that every class's keys are its stage's declared keys
and that each field is the field of `Settings`, so the declarations and the types cannot drift.
The rule params stay the plain nested mapping of those keys (Snakemake's params rerun trigger);
`digest` is the digest of that mapping, which the stage's report records as `config_digest`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, Field

from distlm.documents import Document, read_document, write_document
from distlm.io import digest
from distlm.settings.data import DataSettings
from distlm.settings.eval import EvalSettings
from distlm.settings.inference import (
    EngineSettings,
    InferenceSettings,
    PipelineSettings,
    ServePipelineSettings,
    ServeSettings,
)
from distlm.settings.model import ModelSettings, ModelSourceSettings
from distlm.settings.report import ReportSettings
from distlm.settings.root import Settings
from distlm.settings.runtime import DeviceSettings, ProcessGroupSettings, RuntimeSettings
from distlm.settings.train import TrainSettings
from distlm.settings.transfer import BroadcastSettings, TransferSettings

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
    def of_settings(cls, settings: Settings) -> Self:
        """The stage's part of the typed settings: a section it reads whole is the settings'
        own, one it reads in part (a narrower type) holds those fields of it."""
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

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The dotted config keys this stage reads: a field whose type is the whole section's is
        that section; one of a narrower type (a section read in part) is each of its fields."""
        keys: list[str] = []
        for name, info in cls.model_fields.items():
            if name == "digest":
                continue
            section = info.annotation
            if section is Settings.model_fields[name].annotation:
                keys.append(name)
            else:
                assert isinstance(section, type) and issubclass(section, BaseModel), name
                keys.extend(f"{name}.{sub}" for sub in section.model_fields)
        return tuple(keys)

    def params(self) -> dict:
        """The stage's keys as the rule's params hold them (the mapping `digest` is of): the
        values and key order of the config they came from (distlm.settings.base.Section)."""
        return self.model_dump(exclude={"digest"})


class DataConfig(StageConfig):
    STAGE: ClassVar[str] = "data"
    KIND: ClassVar[str] = "distlm-config-data"
    data: DataSettings
    model: ModelSourceSettings


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


class BroadcastConfig(StageConfig):
    STAGE: ClassVar[str] = "broadcast"
    KIND: ClassVar[str] = "distlm-config-broadcast"
    runtime: ProcessGroupSettings
    transfer: TransferSettings
    broadcast: BroadcastSettings


class TrainConfig(StageConfig):
    STAGE: ClassVar[str] = "train"
    KIND: ClassVar[str] = "distlm-config-train"
    runtime: RuntimeSettings
    train: TrainSettings
    transfer: TransferSettings


class EvalConfig(StageConfig):
    STAGE: ClassVar[str] = "eval"
    KIND: ClassVar[str] = "distlm-config-eval"
    runtime: ProcessGroupSettings
    eval: EvalSettings


class InferenceConfig(StageConfig):
    STAGE: ClassVar[str] = "inference"
    KIND: ClassVar[str] = "distlm-config-inference"
    runtime: DeviceSettings
    inference: InferenceSettings


class ServeConfig(StageConfig):
    STAGE: ClassVar[str] = "serve"
    KIND: ClassVar[str] = "distlm-config-serve"
    runtime: DeviceSettings
    inference: EngineSettings
    serve: ServeSettings


class ServeShardConfig(StageConfig):
    STAGE: ClassVar[str] = "serve_shard"
    KIND: ClassVar[str] = "distlm-config-serve-shard"
    serve: ServePipelineSettings

    @property
    def stages(self) -> int:
        """The served pipeline's stage count: one shard per stage."""
        return self.serve.stages


class ReportConfig(StageConfig):
    STAGE: ClassVar[str] = "report"
    KIND: ClassVar[str] = "distlm-config-report"
    report: ReportSettings


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    c.STAGE: c
    for c in (
        DataConfig,
        ModelConfig,
        ShardConfig,
        BroadcastConfig,
        TrainConfig,
        EvalConfig,
        InferenceConfig,
        ServeConfig,
        ServeShardConfig,
        ReportConfig,
    )
}


def stage_params(settings: Settings, stage: str) -> dict:
    """The params of `stage`'s rule: exactly its keys, from the typed settings of the job's run."""
    return STAGE_CONFIGS[stage].of_settings(settings).params()


def write_stage_config(stage: str, params: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write `results/config/<stage>.json` from the rule's params (rule resolve_config); return
    its digest."""
    doc = STAGE_CONFIGS[stage].of(params)
    write_document(path, doc)
    return doc.digest


def read_stage_config(path: str | os.PathLike, stage: str) -> StageConfig:
    """The typed config of `stage` (a script that knows its class calls read_document)."""
    return read_document(path, STAGE_CONFIGS[stage])
