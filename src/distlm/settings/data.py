"""`data`: the corpus, its splits, the token blocks and the tokenizer of a random init."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.settings.base import Real, Section


class HubSplits(Section):
    train: str = Field("train", description="Name of the train split in the hub data set.")
    validation: str = Field(
        "validation", description="Name of the validation split in the hub data set."
    )
    test: str = Field("test", description="Name of the test split in the hub data set.")


class DataHubSettings(Section):
    path: str = Field(
        "wikitext",
        description="Data set on the Hugging Face hub, or a local folder laid out like one.",
    )
    name: str | None = Field("wikitext-2-raw-v1", description="The data set's configuration name.")
    revision: str | None = Field(None, description="Revision of the hub data set; null = latest.")
    splits: HubSplits = Field(HubSplits(), description="The split names in that data set.")


class DataLocalSettings(Section):
    """Files per split (.txt, .jsonl/.json, .parquet); validation/test may be omitted."""

    train: list[str] = Field([], description="Files of the train split.")
    validation: list[str] = Field(
        [], description="Files of the validation split; empty = carved out of train."
    )
    test: list[str] = Field([], description="Files of the test split; empty = carved out of train.")


class TokenizerSettings(Section):
    """Used only when the model brings no tokenizer (random init)."""

    vocab_size: int = Field(
        4096, ge=300, le=262144, description="Vocabulary of the byte-level BPE trained on train."
    )
    min_frequency: int = Field(2, ge=1, description="Least count of a merged pair in the BPE.")


class DataSettings(Section):
    source: Literal["embedded", "hub", "local"] = Field(
        "embedded",
        description=(
            "embedded (CPython's pydoc_data text), hub (datasets.load_dataset) or local files."
        ),
    )
    hub: DataHubSettings = Field(DataHubSettings(), description="The hub data set (source hub).")
    local: DataLocalSettings = Field(
        DataLocalSettings(),
        description="Files per split (.txt, .jsonl/.json, .parquet); validation/test may be omitted.",
    )
    text_field: str = Field(
        "text", description="Column holding the text in hub, JSON lines and parquet sources."
    )
    separator: str = Field(
        "\n\n", description="Placed between records when a split is joined into one token stream."
    )
    validation_fraction: Real = Field(
        0.05,
        ge=0,
        le=0.5,
        description="Share of documents held out for validation (embedded, train-only local).",
    )
    test_fraction: Real = Field(
        0.05,
        ge=0,
        le=0.5,
        description="Share of documents held out for test (embedded, train-only local).",
    )
    block_size: int = Field(
        128,
        ge=8,
        le=65536,
        description="Tokens per training block; at most model context (n_positions).",
    )
    tokenizer: TokenizerSettings = Field(
        TokenizerSettings(),
        description="Used only when the model brings no tokenizer (random init).",
    )
