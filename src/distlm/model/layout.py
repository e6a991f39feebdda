"""The names and document formats of model and pipeline folders (the package docstring shows
the layout), and the check that a folder's JSON document has the format a reader expects."""

from __future__ import annotations

from pathlib import Path

import torch

from distlm import DistlmError
from distlm.documents import ModelMeta, PipelineMeta
from distlm.io import read_json

WEIGHTS = "model.safetensors"
META = "distlm.json"
SHARDS = "shards"
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FORMAT = ModelMeta.tag()  # distlm.json of a model folder
PIPELINE_FORMAT = PipelineMeta.tag()  # distlm.json of a pipeline folder
SHARDS_FORMAT = "distlm-shards/1"


def read_checked(path: Path, what: str, fmt: str) -> dict:
    """A JSON document of this format and version, or an error naming the file."""
    doc = read_json(path, what=what)
    found = doc.get("format") if isinstance(doc, dict) else None
    if found != fmt:
        raise DistlmError(
            f"{path}: {what} of format {found!r}, expected {fmt!r}; rerun the stage that wrote it"
        )
    return doc
