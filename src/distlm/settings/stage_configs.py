"""The stage configs, all of them: each stage's typed document (distlm.settings.base.StageConfig,
declared beside its section) by stage name, and what the workflow does with them.

    stage_keys("train")                 # ('runtime', 'train', 'transfer')
    stage_params(settings, "train")     # the train rule's params: exactly its keys
    write_stage_config("train", params, "results/config/train.json")   # rule resolve_config
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from distlm.core.documents import write_document
from distlm.settings.base import StageConfig
from distlm.settings.data import DataConfig
from distlm.settings.eval import EvalConfig
from distlm.settings.inference import InferenceConfig, ServeConfig
from distlm.settings.model import ModelConfig, ServeShardConfig, ShardConfig
from distlm.settings.report import ReportConfig
from distlm.settings.root import Settings
from distlm.settings.train import TrainConfig
from distlm.settings.transfer import BroadcastConfig

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


def stage_keys(stage: str) -> tuple[str, ...]:
    """The dotted config keys `stage` reads: a field of its config whose type is the whole
    section's (Settings') is that section; one of a narrower type (a section read in part) is
    each of its fields."""
    keys: list[str] = []
    for name, info in STAGE_CONFIGS[stage].model_fields.items():
        if name == "digest":
            continue
        section = info.annotation
        if section is Settings.model_fields[name].annotation:
            keys.append(name)
        else:
            assert isinstance(section, type) and issubclass(section, BaseModel), name
            keys.extend(f"{name}.{sub}" for sub in section.model_fields)
    return tuple(keys)


def stage_params(settings: Settings, stage: str) -> dict:
    """The params of `stage`'s rule: exactly its keys, from the typed settings of the job's run."""
    return STAGE_CONFIGS[stage].of_settings(settings).params()


def write_stage_config(stage: str, params: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Write `results/config/<stage>.json` from the rule's params (rule resolve_config); return
    its digest."""
    doc = STAGE_CONFIGS[stage].of(params)
    write_document(path, doc)
    return doc.digest
