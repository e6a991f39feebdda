"""Typed settings: one pydantic model per config section, the root `Settings` with the checks
that span keys, and the JSON schema generated from them.

    from distlm.dag.config import load_settings
    s = load_settings("config/config.yaml")      # Settings; ConfigError names a bad key
    s.train.keep_last                            # int >= 1, described in TrainSettings

Each section's model lives in a module named after its owner (runtime, data, model, transfer,
train, eval, inference, report); `python -m distlm.settings --check` keeps
workflow/schemas/config.schema.yaml equal to the schema made from them.
"""

from distlm.settings.base import (
    MAX_SEED,
    ConfigError,
    MaxNewTokens,
    Section,
    Seed,
    Temperature,
    TopK,
    TopP,
    derived_seed,
)
from distlm.settings.data import DataSettings
from distlm.settings.eval import EvalSettings
from distlm.settings.inference import (
    EngineSettings,
    InferenceSettings,
    PipelineSettings,
    SamplingSettings,
    ServePipelineSettings,
    ServeSettings,
)
from distlm.settings.model import ModelSettings, ModelSourceSettings, init_settings
from distlm.settings.report import ReportSettings
from distlm.settings.root import MOVED, Settings, known_architecture
from distlm.settings.runtime import DeviceSettings, ProcessGroupSettings, RuntimeSettings
from distlm.settings.sweep import SweepSettings
from distlm.settings.train import DdpSettings, ProfileSettings, TrainSettings
from distlm.settings.transfer import BroadcastSettings, TransferSettings

__all__ = [
    "MAX_SEED",
    "MOVED",
    "BroadcastSettings",
    "ConfigError",
    "DataSettings",
    "DdpSettings",
    "DeviceSettings",
    "EngineSettings",
    "EvalSettings",
    "InferenceSettings",
    "MaxNewTokens",
    "ModelSettings",
    "ModelSourceSettings",
    "PipelineSettings",
    "ProcessGroupSettings",
    "ProfileSettings",
    "ReportSettings",
    "RuntimeSettings",
    "SamplingSettings",
    "Section",
    "Seed",
    "ServePipelineSettings",
    "ServeSettings",
    "Settings",
    "SweepSettings",
    "Temperature",
    "TopK",
    "TopP",
    "TrainSettings",
    "TransferSettings",
    "derived_seed",
    "init_settings",
    "known_architecture",
]
