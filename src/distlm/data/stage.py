"""The data stage's jobs: the tokenizer (rule data_tokenizer, `make_tokenizer`), one job per shard
(rule tokenize_shard, distlm.data.encode), and the gather (rule prepare_data, `gather`): the
index over the shards, the tokenizer beside it and the stats document. `prepare` runs them all in
one process, in the workflow's layout (a library's or a test's data stage)."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from distlm import DistlmError
from distlm.core.documents import read_document, write_document
from distlm.core.io import atomic_dir
from distlm.core.log import get_logger
from distlm.data.documents import (
    SPLITS,
    DataStats,
    ShardMeta,
    ShardStats,
    SplitStats,
    TokenizerInfo,
    TokenizerSpec,
    TokenMeta,
)
from distlm.data.encode import tokenize_shard
from distlm.data.sharding import (
    DataPlan,
    data_digest,
    plan_data,
    split_origins,
)
from distlm.data.sources import records
from distlm.data.tokenizer import model_tokenizer, named_tokenizer, train_tokenizer
from distlm.data.tokens import (
    read_shard_meta,
    stream_segments,
    token_dtype,
    write_index,
)
from distlm.settings import DataSettings, ModelSourceSettings

log = get_logger(__name__)

SHARDS = "shards"  # results/data/shards/<id>.h5
TOKENIZERS = "tokenizers"  # results/data/tokenizers/<id>/
LISTINGS = "hub"  # results/data/hub/<digest>.json: a hub id's listing


# ----------------------------------------------------------------------------- the tokenizer


def make_tokenizer(spec: TokenizerSpec, out_dir: str | Path, info_path: str | Path) -> None:
    """The tokenizer job: the model's own tokenizer, the named one, or a byte-level BPE trained
    on the train records of the corpus's first `spec.sample_bytes`; saved in transformers' format
    into `out_dir` (atomically), then what it is into `info_path` (TokenizerInfo)."""
    t0 = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        if spec.kind == "model":
            tok = model_tokenizer(ModelSourceSettings.model_validate(spec.model))
            assert tok is not None  # a model's spec is never an init's
            tok.save_pretrained(tmp)
        elif spec.kind == "named":
            assert spec.name is not None
            named_tokenizer(spec.name, spec.vocab_size).save_pretrained(tmp)
        else:
            sample = _sample_texts(spec)
            log.info(
                "training a byte-level BPE tokenizer (vocab %d) on the train records of the "
                "corpus's first %.0f MB",
                spec.vocab_size,
                spec.sample_bytes / 1e6,
            )
            train_tokenizer(sample, spec.vocab_size, spec.min_frequency, tmp)
        tok = settle_tokenizer(tmp)
    info = TokenizerInfo(
        id=spec.id,
        describe=spec.describe(),
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
    )
    write_document(info_path, info)
    log.info(
        "tokenizer %s (%s) in %s, %.1f s",
        spec.id,
        spec.describe(),
        out_dir,
        time.perf_counter() - t0,
    )


def settle_tokenizer(folder: Path):
    """Make the folder's tokenizer.json the tokenizer transformers builds from the folder, which
    the tokenize jobs run without transformers (distlm.data.tokenizer.Encoder): a class that
    rebuilds its backend when loaded (transformers 5's Llama tokenizer from a folder of an older
    one) gets that backend written once, after which loading it changes nothing; one that still
    differs is refused, naming the folder. Returns transformers' tokenizer of the folder."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = folder / "tokenizer.json"
    for attempt in range(2):
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        built = tok.backend_tokenizer
        if path.is_file() and built.to_str() == Tokenizer.from_file(str(path)).to_str():
            return tok
        if attempt == 0:
            built.save(str(path))
    raise DistlmError(
        f"{folder}: transformers builds another tokenizer from this folder than its "
        "tokenizer.json holds, even once rewritten; distlm's tokenize jobs cannot reproduce it"
    )


def _sample_texts(spec: TokenizerSpec):
    """The train records of the sample, until `sample_bytes` of their text."""
    left = spec.sample_bytes
    for source in spec.sample:
        for split, text in records(source):
            if split != "train":
                continue
            yield text
            left -= len(text.encode("utf-8"))
            if left <= 0:
                return


# ----------------------------------------------------------------------------- the gather


def gather(
    dcfg: DataSettings,
    mcfg: ModelSourceSettings,
    *,
    tokenizer_src: str | Path,
    tokenizer_info: str | Path,
    shard_paths: Sequence[str | Path],
    tokens_path: str | Path,
    tokenizer_dir: str | Path,
    stats_path: str | Path,
) -> DataStats:
    """The gather (rule prepare_data): the shards' streams strung into the index, the tokenizer
    copied beside it, and the stats; each written atomically, in that order, so stats.json (last)
    exists only beside the others. Refuses a split with no block, or shards of another tokenizer."""
    t0 = time.perf_counter()
    tokenizer_src, tokens_path = Path(tokenizer_src), Path(tokens_path)
    origins = split_origins(dcfg)
    if not shard_paths:
        raise DistlmError(
            f"{tokens_path}: no shard to gather (a token file of the release before, kept while "
            "it matched the config, was removed): run the same command again to tokenize the "
            "corpus into shards"
        )
    info = read_document(tokenizer_info, TokenizerInfo)
    vocab_size = info.vocab_size
    dtype = token_dtype(vocab_size)
    shards = [(Path(p), read_shard_meta(p)) for p in shard_paths]
    for path, meta in shards:
        if meta.spec.tokenizer != tokenizer_src.name or np.dtype(meta.dtype) != dtype:
            raise DistlmError(
                f"{path}: a shard of tokenizer {meta.spec.tokenizer} (ids {meta.dtype}), not of "
                f"{tokenizer_src} ({dtype.str}): tokenize it again (delete it and run again)"
            )
    streams = {s: stream_segments(shards, s) for s in SPLITS}
    split_tokens = {s: sum(seg.stop - seg.start for seg in streams[s]) for s in SPLITS}
    documents = {s: sum(m.splits[s].documents for _, m in shards) for s in SPLITS}
    files = ", ".join(dict.fromkeys(u.file for _, m in shards for u in m.spec.source.units))
    if not any(documents.values()):
        raise DistlmError(f"the corpus has no text: every record of {files} is empty")
    bs = dcfg.block_size
    for s in SPLITS:
        if documents[s] == 0:
            raise DistlmError(f"data split {s!r} is empty ({origins.get(s, files)})")
        if split_tokens[s] < bs:
            raise DistlmError(
                f"data split {s!r} ({origins.get(s, files)}) has {split_tokens[s]} tokens, fewer "
                f"than data.block_size={bs}: it yields no block"
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
        "config_digest": data_digest(dcfg, mcfg),
        "tokenizer": _tokenizer_kind(dcfg, mcfg),
        "vocab_size": vocab_size,
        "eos_token_id": info.eos_token_id,
        "block_size": bs,
    }
    write_index(tokens_path, streams, meta=TokenMeta(**meta), dtype=dtype)
    with atomic_dir(tokenizer_dir) as tmp:
        shutil.copytree(tokenizer_src, tmp, dirs_exist_ok=True)
    holding = {s: sum(1 for _, m in shards if m.splits[s].records) for s in SPLITS}
    stats = DataStats(
        **meta,
        splits={
            s: SplitStats(
                documents=documents[s],
                tokens=split_tokens[s],
                blocks=split_tokens[s] // bs,
                tail_tokens_not_in_blocks=split_tokens[s] % bs,
                tokens_sha256=stream_sha256(tokens_path, s),
                origin=origins.get(s, ""),
                shards=holding[s],
            )
            for s in SPLITS
        },
        shards=tuple(_shard_stats(m) for _, m in shards),
        seconds=round(time.perf_counter() - t0, 3),
    )
    write_document(stats_path, stats)
    log.info(
        "wrote %s over %d shard(s): %s",
        tokens_path,
        len(shards),
        ", ".join(f"{s} {v.blocks} blocks/{v.tokens} tokens" for s, v in stats.splits.items()),
    )
    return stats


def _tokenizer_kind(dcfg: DataSettings, mcfg: ModelSourceSettings) -> str:
    if mcfg.source != "init":
        return f"the model's own ({mcfg.name})"
    if dcfg.tokenizer.name is not None:
        return f"{dcfg.tokenizer.name}'s"
    return "byte-level BPE trained on the train split"


def stream_sha256(index: Path, split: str, chunk: int = 1 << 22) -> str:
    """sha256 of a split's stream as int64 bytes, read a chunk at a time through the index (plain
    reads: a memory map would keep every page it read resident)."""
    import h5py

    h = hashlib.sha256()
    with h5py.File(index, "r") as f:
        ds = f[f"{split}/tokens"]
        assert isinstance(ds, h5py.Dataset)
        for a in range(0, ds.shape[0], chunk):
            h.update(ds[a : a + chunk].astype(np.int64).tobytes())
    return h.hexdigest()


def _shard_stats(meta: ShardMeta) -> ShardStats:
    return ShardStats(
        id=meta.spec.id,
        where=meta.spec.source.where(),
        text_bytes=sum(p.text_bytes for p in meta.splits.values()),
        tokens={s: p.tokens for s, p in meta.splits.items()},
        documents={s: p.documents for s, p in meta.splits.items()},
        seconds=meta.seconds,
        tokens_per_s=meta.tokens_per_s,
        peak_rss_mb=round(meta.peak_rss_bytes / 1e6, 1),
    )


# ----------------------------------------------------------------------------- in one process


def prepare(
    dcfg: DataSettings,
    mcfg: ModelSourceSettings,
    *,
    tokens_path: str | Path,
    tokenizer_dir: str | Path,
    stats_path: str | Path,
    plan: DataPlan | None = None,
) -> DataStats:
    """The whole data stage in this process: the plan, the tokenizer and every shard (each made
    only when its file is missing, under the token file's folder, as the workflow lays them out),
    then the gather."""
    root = Path(tokens_path).parent
    plan = plan or plan_data(dcfg, mcfg, listings=root / LISTINGS)
    tok_dir = root / TOKENIZERS / plan.tokenizer.id
    tok_info = tok_dir.with_suffix(".json")
    if not tok_info.is_file():
        make_tokenizer(plan.tokenizer, tok_dir, tok_info)
    paths = []
    for spec in plan.shards:
        path = root / SHARDS / f"{spec.id}.h5"
        if not path.is_file():
            tokenize_shard(spec, tokenizer_dir=tok_dir, out_path=path)
        paths.append(path)
    return gather(
        dcfg,
        mcfg,
        tokenizer_src=tok_dir,
        tokenizer_info=tok_info,
        shard_paths=paths,
        tokens_path=tokens_path,
        tokenizer_dir=tokenizer_dir,
        stats_path=stats_path,
    )
