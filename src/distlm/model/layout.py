"""The names and document formats of model and pipeline folders (the package docstring shows
the layout)."""

from __future__ import annotations

import torch

from distlm.model.documents import ModelMeta, PipelineMeta, ShardManifest

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
META = "distlm.json"
SHARDS = "shards"
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FORMAT = ModelMeta.tag()  # distlm.json of a model folder
PIPELINE_FORMAT = PipelineMeta.tag()  # distlm.json of a pipeline folder
SHARDS_FORMAT = ShardManifest.tag()  # shards/manifest.json of a pipeline folder
