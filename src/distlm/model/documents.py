"""The documents of folders that hold weights: a model folder's metadata (`ModelMeta`,
distlm.json), a pipeline folder's (`PipelineMeta`) and its shards' manifest (`ShardManifest`), and
a training checkpoint's index (`CheckpointIndex`: training writes it, a live update of the server
reads it, so it sits here, below both)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from distlm.core.documents import Document
from distlm.family.table import Cut

# ----------------------------------------------------------------------------- model folders


class ModelMeta(Document):
    """distlm.json of a model folder (the model stage's, or training's final folder): where the
    weights came from, and the sha256 of model.safetensors that every later stage verifies
    (distlm.model.verify_model_folder). A folder distlm wrote always carries its hash."""

    KIND: ClassVar[str] = "distlm-model"
    VERSION: ClassVar[int] = 1
    created_by: str
    source: dict
    config_digest: str
    data_config_digest: str
    dtype: str
    training: dict | None = None  # the training record; only in training's final folder
    model_sha256: str
    n_layer: int
    n_positions: int
    vocab_size: int
    parameters: int
    arch_digest: str

    def to_json(self) -> dict:
        out = super().to_json()
        if out["training"] is None:  # a model-stage folder: no key, as it always was
            del out["training"]
        return out


class PipelineMeta(ModelMeta):
    """distlm.json of a pipeline folder (rule shard): its source folder's metadata, the source
    folder and the stages' layer ranges."""

    KIND: ClassVar[str] = "distlm-pipeline"
    VERSION: ClassVar[int] = 1
    source_model: str
    stages: list[dict]


class ShardEntry(BaseModel):
    """One stage's shard in shards/manifest.json: its decoder layers [start, end), whether it
    holds the embeddings (the first stage) and the final norm and head (the last), its tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: int
    file: str
    layers: tuple[int, int]
    has_embeddings: bool
    has_head: bool
    tensors: list[str]
    bytes: int
    sha256: str

    @property
    def cut(self) -> Cut:
        """What of the model this stage holds (distlm.family's `Cut`)."""
        return Cut(*self.layers, first=self.has_embeddings, last=self.has_head)


class ShardManifest(Document):
    """shards/manifest.json of a pipeline folder (rule shard): the stage shards of a model folder,
    cut by its family (distlm.family), with `tied` the last stage's copies of tied tensors
    ({"lm_head.weight": the input embedding}, or {} when the head is its own)."""

    KIND: ClassVar[str] = "distlm-shards"
    VERSION: ClassVar[int] = 1
    stages: int
    n_layer: int
    model_sha256: str
    tied: dict[str, str]
    shards: list[ShardEntry]


# ----------------------------------------------------------------------------- checkpoints


class CheckpointIndex(Document):
    """checkpoint.json of a training checkpoint, written last: the sha256 of every other file."""

    KIND: ClassVar[str] = "distlm-checkpoint"
    VERSION: ClassVar[int] = 1
    step: int
    sha256: dict[str, str]
