"""`data`: the corpus, its splits, the token blocks and the tokenizer of a random init."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from distlm.core.section import ONLY_WHEN_SET
from distlm.settings.base import Real, Section, StageConfig
from distlm.settings.model import ModelSourceSettings


class HubSplits(Section):
    train: str = Field(default="train", description="Name of the train split in the hub data set.")
    validation: str | None = Field(
        default="validation",
        description=(
            "Name of the validation split in the hub data set; null = carved out of train "
            "(data.validation_fraction of its documents, by a hash of each document's text)."
        ),
    )
    test: str | None = Field(
        default="test",
        description=(
            "Name of the test split in the hub data set; null = carved out of train "
            "(data.test_fraction of its documents, by a hash of each document's text)."
        ),
    )


class DataHubSettings(Section):
    path: str = Field(
        default="wikitext",
        description="Data set on the Hugging Face hub, or a local folder laid out like one.",
    )
    name: str | None = Field(
        default="wikitext-2-raw-v1", description="The data set's configuration name."
    )
    revision: str | None = Field(
        default=None, description="Revision of the hub data set; null = latest."
    )
    splits: HubSplits = Field(default=HubSplits(), description="The split names in that data set.")


class DataLocalSettings(Section):
    """Files per split (.txt, .jsonl/.json, .parquet); validation/test may be omitted. An entry
    may be a glob (`corpus/*.jsonl`): its files in sorted order."""

    train: list[str] = Field(default=[], description="Files (or globs) of the train split.")
    validation: list[str] = Field(
        default=[], description="Files of the validation split; empty = carved out of train."
    )
    test: list[str] = Field(
        default=[], description="Files of the test split; empty = carved out of train."
    )


class TokenizerSettings(Section):
    """Used only when the model brings no tokenizer (random init)."""

    vocab_size: int = Field(
        default=4096,
        ge=300,
        le=262144,
        description="Vocabulary of the byte-level BPE trained on train.",
    )
    min_frequency: int = Field(
        default=2, ge=1, description="Least count of a merged pair in the BPE."
    )
    sample_mb: Real = Field(
        default=128,
        gt=0,
        **ONLY_WHEN_SET,
        description=(
            "The BPE trains on the train records of the corpus's first this many MB (in file "
            "order), so its memory and time are bounded whatever the corpus's size."
        ),
    )
    name: str | None = Field(
        default=None,
        **ONLY_WHEN_SET,
        description=(
            "A hub id or tokenizer folder whose tokenizer a random init uses instead of training "
            "a BPE (gpt2: GPT-2's, as nanoGPT and llm.c pretrain with); vocab_size must be at "
            "least its size. null = train a BPE."
        ),
    )


class DataSettings(Section):
    source: Literal["embedded", "hub", "local"] = Field(
        default="embedded",
        description=(
            "embedded (CPython's pydoc_data text), hub (datasets.load_dataset) or local files."
        ),
    )
    hub: DataHubSettings = Field(
        default=DataHubSettings(), description="The hub data set (source hub)."
    )
    local: DataLocalSettings = Field(
        default=DataLocalSettings(),
        description="Files per split (.txt, .jsonl/.json, .parquet); validation/test may be omitted.",
    )
    text_field: str = Field(
        default="text",
        description="Column holding the text in hub, JSON lines and parquet sources.",
    )
    separator: str = Field(
        default="\n\n",
        description="Placed between records when a split is joined into one token stream.",
    )
    validation_fraction: Real = Field(
        default=0.05,
        ge=0,
        le=0.5,
        description="Share of documents held out for validation (embedded, train-only local).",
    )
    test_fraction: Real = Field(
        default=0.05,
        ge=0,
        le=0.5,
        description="Share of documents held out for test (embedded, train-only local).",
    )
    shard_mb: Real = Field(
        default=64,
        gt=0,
        **ONLY_WHEN_SET,
        description=(
            "The corpus is cut into shards of about this many MB of text, each tokenized by a "
            "job of its own (a .jsonl file by byte range, a .parquet file by row groups, small "
            "files packed together)."
        ),
    )
    block_size: int = Field(
        default=128,
        ge=8,
        le=65536,
        description="Tokens per training block; at most model context (n_positions).",
    )
    tokenizer: TokenizerSettings = Field(
        default=TokenizerSettings(),
        description="Used only when the model brings no tokenizer (random init).",
    )


# ----------------------------------------------------------------------------- the stage's keys


class DataConfig(StageConfig):
    STAGE: ClassVar[str] = "data"
    KIND: ClassVar[str] = "distlm-config-data"
    data: DataSettings
    model: ModelSourceSettings
