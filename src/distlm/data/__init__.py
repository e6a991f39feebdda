"""Dataset prep: raw text -> tokenizer + train/validation/test token blocks in HDF5 + stats JSON.

Sources (config `data.source`):
  embedded  CPython's reference documentation text (`pydoc_data.topics`): real English prose and
            code samples that are on disk wherever Python is; each topic is one document.
  hub       `datasets.load_dataset(path, name)`, e.g. wikitext / wikitext-2-raw-v1; one record per row.
  local     .txt (one document per file), .jsonl/.json (one per line), .parquet (one per row).

Each split is joined into one token stream (records separated by `data.separator`) and cut into
blocks of `data.block_size` tokens. The HDF5 file holds, per split, the whole stream (`tokens`,
for sliding-window evaluation) and its blocks (`blocks`, N x block_size, chunked by rows so a
reader streams only the blocks it needs).

The package, by part: `sources` (the corpus, split into documents), `tokenizer` (train, load,
encode), `tokens` (the HDF5 token file: write, read blocks, metadata), `stage` (the data stage,
`prepare`: all of it, and the stats document). Import from `distlm.data`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names

if TYPE_CHECKING:
    from distlm.data.sources import (
        EOS,
        SPLITS,
        Split,
        load_embedded,
        load_hub,
        load_local,
        load_splits,
        read_local_file,
        split_documents,
    )
    from distlm.data.stage import prepare
    from distlm.data.tokenizer import encode, load_tokenizer, model_tokenizer, train_tokenizer
    from distlm.data.tokens import (
        FORMAT,
        TokenBlocks,
        check_tokens_file,
        read_tokens_meta,
        token_dtype,
        write_tokens,
    )

# Imported when first asked for (PEP 562), so that a light module of this package (its documents)
# can be imported without the rest: the report and distlm-launch read documents, and must not
# import torch for them.
_WHERE = {
    "EOS": "distlm.data.sources",
    "FORMAT": "distlm.data.tokens",
    "SPLITS": "distlm.data.sources",
    "Split": "distlm.data.sources",
    "TokenBlocks": "distlm.data.tokens",
    "check_tokens_file": "distlm.data.tokens",
    "encode": "distlm.data.tokenizer",
    "load_embedded": "distlm.data.sources",
    "load_hub": "distlm.data.sources",
    "load_local": "distlm.data.sources",
    "load_splits": "distlm.data.sources",
    "load_tokenizer": "distlm.data.tokenizer",
    "model_tokenizer": "distlm.data.tokenizer",
    "prepare": "distlm.data.stage",
    "read_local_file": "distlm.data.sources",
    "read_tokens_meta": "distlm.data.tokens",
    "split_documents": "distlm.data.sources",
    "token_dtype": "distlm.data.tokens",
    "train_tokenizer": "distlm.data.tokenizer",
    "write_tokens": "distlm.data.tokens",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = [
    "EOS",
    "FORMAT",
    "SPLITS",
    "Split",
    "TokenBlocks",
    "check_tokens_file",
    "encode",
    "load_embedded",
    "load_hub",
    "load_local",
    "load_splits",
    "load_tokenizer",
    "model_tokenizer",
    "prepare",
    "read_local_file",
    "read_tokens_meta",
    "split_documents",
    "token_dtype",
    "train_tokenizer",
    "write_tokens",
]
