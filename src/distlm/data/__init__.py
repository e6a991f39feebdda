"""Dataset prep: raw text -> tokenizer + train/validation/test token streams in HDF5 shards behind
one index + stats JSON.

Sources (config `data.source`):
  embedded  CPython's reference documentation text (`pydoc_data.topics`): real English prose and
            code samples that are on disk wherever Python is; each topic is one document.
  hub       a hub data set's data files (`datasets` resolves its configs), e.g. wikitext /
            wikitext-2-raw-v1 or HuggingFaceFW/fineweb-edu / sample-10BT; one record per row.
  local     .txt (one document per file), .jsonl/.json (one per line), .parquet (one per row).

The stage is jobs the workflow schedules (docs/stages.md): the plan cuts the corpus into shards
(`sharding`), one job makes the tokenizer, one job per shard tokenizes it as a stream (`encode`),
and the gather strings the shards into the index and writes the stats (`stage`). Each split is
one token stream (records separated by `data.separator`) cut into blocks of `data.block_size`
tokens; the trainer maps the shards into memory and reads a step's blocks (`tokens.TokenBlocks`).

The package, by part: `documents` (the specs, metadata and stats), `sources` (records as a
stream, and which split each goes to), `sharding` (the plan: the shards and the tokenizer of a
config, and the workflow's view of it), `tokenizer` (train, load, the jobs' encoder), `encode` (a
tokenize job), `tokens` (shard files, the index, reading blocks), `stage` (the tokenizer job, the
gather, and all of it in one process, `prepare`). Import from `distlm.data`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names

if TYPE_CHECKING:
    from distlm.data.documents import SPLITS
    from distlm.data.encode import tokenize_shard
    from distlm.data.sharding import DataPlan, data_digest, plan_data
    from distlm.data.sources import EOS, load_embedded
    from distlm.data.stage import gather, make_tokenizer, prepare
    from distlm.data.tokenizer import load_tokenizer, model_tokenizer, train_tokenizer
    from distlm.data.tokens import (
        FORMAT,
        TokenBlocks,
        check_tokens_file,
        read_tokens_meta,
        token_dtype,
    )

# Imported when first asked for (PEP 562), so that a light module of this package (its documents,
# its plan) can be imported without the rest: the report, the workflow and distlm-launch read
# them, and must not import torch for them.
_WHERE = {
    "EOS": "distlm.data.sources",
    "FORMAT": "distlm.data.tokens",
    "SPLITS": "distlm.data.documents",
    "DataPlan": "distlm.data.sharding",
    "TokenBlocks": "distlm.data.tokens",
    "check_tokens_file": "distlm.data.tokens",
    "data_digest": "distlm.data.sharding",
    "gather": "distlm.data.stage",
    "load_embedded": "distlm.data.sources",
    "load_tokenizer": "distlm.data.tokenizer",
    "make_tokenizer": "distlm.data.stage",
    "model_tokenizer": "distlm.data.tokenizer",
    "plan_data": "distlm.data.sharding",
    "prepare": "distlm.data.stage",
    "read_tokens_meta": "distlm.data.tokens",
    "token_dtype": "distlm.data.tokens",
    "tokenize_shard": "distlm.data.encode",
    "train_tokenizer": "distlm.data.tokenizer",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = [
    "EOS",
    "FORMAT",
    "SPLITS",
    "DataPlan",
    "TokenBlocks",
    "check_tokens_file",
    "data_digest",
    "gather",
    "load_embedded",
    "load_tokenizer",
    "make_tokenizer",
    "model_tokenizer",
    "plan_data",
    "prepare",
    "read_tokens_meta",
    "token_dtype",
    "tokenize_shard",
    "train_tokenizer",
]
