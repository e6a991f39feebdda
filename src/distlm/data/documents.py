"""The data stage's documents: what a tokenize job is asked to do (`ShardSpec`, its rule's params;
the shard file's name is its digest), what the tokenizer job is asked to make (`TokenizerSpec`),
a shard file's metadata (`ShardMeta`), the token index's (`TokenMeta`) and the stats of what the
stage made of the corpus (`DataStats`, results/data/stats.json)."""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from distlm import DistlmError
from distlm.core.documents import Document, DocumentError, Part
from distlm.core.io import digest, read_json

SplitName = Literal["train", "validation", "test"]
SPLITS: tuple[SplitName, ...] = ("train", "validation", "test")
ID_CHARS = 16  # hex digits of a shard's or tokenizer's digest in its path (64 bits)

# ----------------------------------------------------------------------------- what a job reads


class Unit(Part):
    """A piece of one corpus file: a byte range of a .jsonl (its records are the lines that start
    in it), a whole .txt (one document), a range of a .parquet's row groups, or the embedded
    corpus. `size`, the file's bytes when planned, is part of its identity: a file that grew or
    shrank is another unit, so its shard is tokenized again."""

    file: str  # as the config names it (a path, relative or not) or a hub data file's URL
    format: Literal["embedded", "txt", "jsonl", "parquet"]
    size: int
    start: int  # bytes (txt, jsonl) or row groups (parquet)
    stop: int
    text_bytes: int  # about how much text it holds: what shards are packed by

    def where(self) -> str:
        if self.format == "parquet":
            return f"{self.file} (row groups {self.start}-{self.stop - 1})"
        if self.format == "jsonl" and (self.start, self.stop) != (0, self.size):
            return f"{self.file} (bytes {self.start}-{self.stop})"
        return self.file


class Carve(Part):
    """How records without a split of their own are dealt out: `hash`, by a hash of each
    document's text (stable when files are added: a document's split is its own); `name_rank`,
    the embedded corpus's rule, by the rank of a hash of each topic's name (a fixed corpus: the
    blocks it gives are the release before's, bit for bit)."""

    rule: Literal["hash", "name_rank"]
    validation: float
    test: float


class Source(Part):
    """Where a shard's records come from and which split each goes to: `split` for files of one
    split, else `carve`."""

    kind: Literal["embedded", "local", "hub"]
    units: tuple[Unit, ...]
    split: SplitName | None = None
    carve: Carve | None = None
    text_field: str

    @property
    def text_bytes(self) -> int:
        return sum(u.text_bytes for u in self.units)

    def where(self) -> str:
        return ", ".join(u.where() for u in self.units)


class ShardSpec(Document):
    """One tokenize job (rule tokenize_shard): its source, how records are joined, and the
    tokenizer (by id). Its digest names its file, results/data/shards/<id>.h5: a finished shard is
    found again by any config that asks for the same one, and an edit that changes it gets a new
    file beside the old."""

    KIND: ClassVar[str] = "distlm-shard-spec"
    VERSION: ClassVar[int] = 1
    source: Source
    separator: str
    tokenizer: str  # TokenizerSpec.id

    @property
    def id(self) -> str:
        return digest(self.to_json())[:ID_CHARS]


class TokenizerSpec(Document):
    """The tokenizer job (rule data_tokenizer): the model's own tokenizer (`model`), a named one
    for a random init (`named`), or a byte-level BPE trained on `sample` (`trained`: the train
    records of the corpus's first `sample_bytes`). Its digest names its folder,
    results/data/tokenizers/<id>/."""

    KIND: ClassVar[str] = "distlm-tokenizer-spec"
    VERSION: ClassVar[int] = 1
    kind: Literal["model", "named", "trained"]
    model: dict | None = None  # model.source, name, revision (kind model)
    name: str | None = None  # data.tokenizer.name (kind named)
    vocab_size: int
    min_frequency: int
    sample: tuple[Source, ...] = ()
    sample_bytes: int = 0

    @property
    def id(self) -> str:
        return digest(self.to_json())[:ID_CHARS]

    def describe(self) -> str:
        if self.kind == "model":
            return f"the model's own ({(self.model or {}).get('name')})"
        if self.kind == "named":
            return f"{self.name}'s"
        return "byte-level BPE trained on the train split"


# ----------------------------------------------------------------------------- what a job wrote


class TokenizerInfo(Document):
    """What the tokenizer job made (results/data/tokenizers/<id>.json, beside the folder), as
    transformers counts it: the gather writes it into the token index's metadata without loading
    the tokenizer again."""

    KIND: ClassVar[str] = "distlm-tokenizer-info"
    VERSION: ClassVar[int] = 1
    id: str
    describe: str
    vocab_size: int  # len(tokenizer)
    eos_token_id: int | None


class ShardSplit(Part):
    """One split's part of a shard: its records, and its token stream (`tokens`: every record
    followed by the separator; `last`: the last record alone, which ends the split's stream when
    this shard is the split's last)."""

    records: int
    documents: int  # records with text (not only whitespace)
    text_bytes: int
    tokens: int
    last_piece: int  # tokens of the last record and its separator, at the end of `tokens`
    last: int  # tokens of the last record alone


class ShardMeta(Document):
    """A shard file's metadata (results/data/shards/<id>.h5: its `format` attribute is the tag,
    its `meta` attribute the body)."""

    KIND: ClassVar[str] = "distlm-token-shard"
    VERSION: ClassVar[int] = 1
    spec: ShardSpec
    vocab_size: int  # the tokenizer's, as the tokenizers library counts its ids
    dtype: str
    splits: dict[SplitName, ShardSplit]
    seconds: float
    tokens_per_s: float
    peak_rss_bytes: int  # the job's process at its end (its peak resident memory)


class TokenMeta(Document):
    """The token file's metadata (results/data/tokens.h5, distlm.data.tokens): its HDF5 `format`
    attribute is the tag, its `meta` attribute the body, so the file is one document. Version 2
    is an index: each split's `tokens` is an HDF5 virtual dataset over the shard files; version 1
    (the release before) held every split's stream and blocks itself, and still reads."""

    KIND: ClassVar[str] = "distlm-tokens"
    VERSION: ClassVar[int] = 2
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int


# ----------------------------------------------------------------------------- dataset prep


class SplitStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    documents: int
    tokens: int
    blocks: int
    tail_tokens_not_in_blocks: int
    tokens_sha256: str  # of the split's stream as int64 bytes (what eval's reports give too)
    origin: str = ""  # how the split was made: its files, or carved out of train (and how)
    shards: int = 0  # shards that hold some of it


class ShardStats(Part):
    """One tokenize job, as the stats show it."""

    id: str
    where: str  # its files and ranges
    text_bytes: int
    tokens: dict[SplitName, int]
    documents: dict[SplitName, int]
    seconds: float
    tokens_per_s: float
    peak_rss_mb: float


class DataStats(Document):
    """results/data/stats.json: what the dataset-prep stage made of the corpus."""

    KIND: ClassVar[str] = "distlm-data-stats"
    VERSION: ClassVar[int] = 2
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    splits: dict[str, SplitStats]
    shards: tuple[ShardStats, ...] = ()
    seconds: float


def read_stats(path: str | os.PathLike) -> DataStats:
    """The stats document; one of version 1 (the release before: no shards, no origins) reads as
    this version with those left empty, so a results folder of that release reports unchanged."""
    try:
        obj = read_json(path, "DataStats")
    except DistlmError as e:
        raise DocumentError(str(e)) from None
    if isinstance(obj, dict) and obj.get("format") == f"{DataStats.KIND}/1":
        obj = {**obj, "format": DataStats.tag()}
    return DataStats.from_json(obj, str(path))
