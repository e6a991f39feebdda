"""The data stage (rule data): sources -> tokenizer -> token file -> stats document."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from distlm import DistlmError
from distlm.core.documents import write_document
from distlm.core.io import atomic_dir, digest
from distlm.core.log import get_logger
from distlm.data.documents import DataStats, SplitStats, TokenMeta
from distlm.data.sources import SPLITS, Split, load_splits
from distlm.data.tokenizer import encode, model_tokenizer, train_tokenizer
from distlm.data.tokens import write_tokens
from distlm.settings import DataSettings, ModelSourceSettings

log = get_logger(__name__)


def prepare(
    dcfg: DataSettings,
    mcfg: ModelSourceSettings,
    *,
    tokens_path: str | Path,
    tokenizer_dir: str | Path,
    stats_path: str | Path,
) -> DataStats:
    """Run the dataset-prep stage (the data stage's keys: `data` and which model); returns the
    stats written."""
    t0 = time.perf_counter()
    tokenizer_from = mcfg.model_dump() if mcfg.source != "init" else None
    cfg_digest = digest({"data": dcfg.model_dump(), "tokenizer_from": tokenizer_from})
    splits = load_splits(dcfg)
    for s in SPLITS:
        log.info("split %s: %d documents from %s", s, splits[s].documents, splits[s].origin)

    # Each output is renamed into place when complete, in the order tokens, tokenizer, stats: a
    # kill anywhere leaves no partial file, and stats.json (last) exists only beside the others.
    with atomic_dir(tokenizer_dir) as tok_tmp:
        stats = _tokenize_and_write(dcfg, mcfg, splits, tok_tmp, cfg_digest, Path(tokens_path), t0)
    write_document(stats_path, stats)
    return stats


def _tokenize_and_write(
    dcfg: DataSettings,
    mcfg: ModelSourceSettings,
    splits: dict[str, Split],
    tok_tmp: Path,
    cfg_digest: str,
    tokens_path: Path,
    t0: float,
) -> DataStats:
    tok = model_tokenizer(mcfg)
    if tok is None:
        log.info(
            "training a byte-level BPE tokenizer (vocab %d) on the train split",
            dcfg.tokenizer.vocab_size,
        )
        tok = train_tokenizer(
            splits["train"].records,
            dcfg.tokenizer.vocab_size,
            dcfg.tokenizer.min_frequency,
            tok_tmp,
        )
        tok_kind = "byte-level BPE trained on the train split"
    else:
        tok.save_pretrained(tok_tmp)
        tok_kind = f"the model's own ({mcfg.name})"
    vocab_size = len(tok)

    streams = {s: encode(tok, splits[s], dcfg.separator) for s in SPLITS}
    bs = dcfg.block_size
    for s, ids in streams.items():
        if len(ids) < bs:
            raise DistlmError(
                f"data split {s!r} ({splits[s].origin}) has {len(ids)} tokens, fewer than "
                f"data.block_size={bs}: it yields no block"
            )
    source: dict = {"kind": dcfg.source}
    if dcfg.source == "hub":
        source.update(dcfg.hub.model_dump(include={"path", "name", "revision"}))
    elif dcfg.source == "local":
        source["files"] = dcfg.local.model_dump()
    else:
        source["corpus"] = "pydoc_data.topics (CPython reference documentation)"
    meta = {
        "source": source,
        "config_digest": cfg_digest,
        "tokenizer": tok_kind,
        "vocab_size": vocab_size,
        "eos_token_id": tok.eos_token_id,
        "block_size": bs,
    }
    write_tokens(Path(tokens_path), streams, bs, vocab_size, TokenMeta(**meta))
    stats = DataStats(
        **meta,
        splits={
            s: SplitStats(
                documents=splits[s].documents,
                tokens=len(ids),
                blocks=int(len(ids) // bs),
                tail_tokens_not_in_blocks=int(len(ids) % bs),
                tokens_sha256=hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest(),
            )
            for s, ids in streams.items()
        },
        seconds=round(time.perf_counter() - t0, 3),
    )
    log.info(
        "wrote %s: %s",
        tokens_path,
        ", ".join(f"{s} {v.blocks} blocks/{v.tokens} tokens" for s, v in stats.splits.items()),
    )
    return stats
