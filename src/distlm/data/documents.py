"""The data stage's documents: the token file's metadata (`TokenMeta`) and the stats of what it
made of the corpus (`DataStats`, results/data/stats.json)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from distlm.core.documents import Document

# ----------------------------------------------------------------------------- dataset prep


class SplitStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    documents: int
    tokens: int
    blocks: int
    tail_tokens_not_in_blocks: int
    tokens_sha256: str


class DataStats(Document):
    """results/data/stats.json: what the dataset-prep stage made of the corpus."""

    KIND: ClassVar[str] = "distlm-data-stats"
    VERSION: ClassVar[int] = 1
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    splits: dict[str, SplitStats]
    seconds: float


class TokenMeta(Document):
    """The token file's metadata (results/data/tokens.h5, distlm.data.tokens): its HDF5 `format`
    attribute is the tag, its `meta` attribute the body, so the file is one document."""

    KIND: ClassVar[str] = "distlm-tokens"
    VERSION: ClassVar[int] = 1
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int
