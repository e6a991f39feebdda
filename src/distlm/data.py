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
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from distlm import DistlmError
from distlm.documents import DataStats, SplitStats, write_document
from distlm.io import atomic_dir, atomic_path, digest
from distlm.log import get_logger, progress
from distlm.settings import DataSettings, ModelSourceSettings

log = get_logger(__name__)

SPLITS = ("train", "validation", "test")
EOS = "<|endoftext|>"
FORMAT = "distlm-tokens/1"


@dataclass
class Split:
    """The records of one split and where they came from (for error messages)."""

    name: str
    records: list[str] = field(default_factory=list)
    origin: str = ""

    @property
    def documents(self) -> int:
        return sum(1 for r in self.records if r.strip())


# ----------------------------------------------------------------------------- sources


def load_embedded() -> list[tuple[str, str]]:
    """(name, text) of every topic of CPython's pydoc_data, sorted by name."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - part of every CPython
        raise DistlmError(f"data.source embedded: pydoc_data is not importable ({e})") from None
    docs = sorted((k, v) for k, v in topics.items() if v.strip())
    if not docs:
        raise DistlmError("data.source embedded: pydoc_data.topics is empty")
    return docs


def split_documents(
    docs: Sequence[tuple[str, str]], validation_fraction: float, test_fraction: float, origin: str
) -> dict[str, Split]:
    """Assign whole documents to splits by a hash of their name: stable, independent of order."""
    ordered = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
    n = len(ordered)
    n_val = max(1, round(validation_fraction * n)) if validation_fraction > 0 else 0
    n_test = max(1, round(test_fraction * n)) if test_fraction > 0 else 0
    if n - n_val - n_test < 1:
        raise DistlmError(
            f"{origin}: {n} documents cannot be split into train/validation/test "
            f"(validation_fraction={validation_fraction}, test_fraction={test_fraction})"
        )
    parts = {
        "validation": ordered[:n_val],
        "test": ordered[n_val : n_val + n_test],
        "train": ordered[n_val + n_test :],
    }
    # Keep the source order inside each split so the stream reads like the original.
    rank = {name: i for i, (name, _) in enumerate(docs)}
    return {
        s: Split(s, [t for _, t in sorted(parts[s], key=lambda d: rank[d[0]])], origin)
        for s in SPLITS
    }


def read_local_file(path: str | Path, text_field: str) -> list[str]:
    """Records of one local file; the error names the file (and line) at fault."""
    path = Path(path)
    if not path.is_file():
        raise DistlmError(f"data.local: corpus file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix in (".txt", ".text", ".md", ".raw"):
            records = [path.read_text(encoding="utf-8")]
        elif suffix in (".jsonl", ".json"):
            records = []
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DistlmError(f"{path}:{i}: not valid JSON ({e})") from None
                    if not isinstance(obj, dict) or text_field not in obj:
                        raise DistlmError(f"{path}:{i}: no field {text_field!r} (data.text_field)")
                    records.append(str(obj[text_field]))
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if text_field not in table.column_names:
                raise DistlmError(
                    f"{path}: no column {text_field!r} (data.text_field); "
                    f"columns: {table.column_names}"
                )
            records = [str(x) for x in table.column(text_field).to_pylist() if x is not None]
        else:
            raise DistlmError(
                f"{path}: unknown corpus format {suffix!r} (use .txt, .jsonl, .json or .parquet)"
            )
    except UnicodeDecodeError as e:
        raise DistlmError(f"{path}: not UTF-8 text ({e})") from None
    if not any(r.strip() for r in records):
        raise DistlmError(f"{path}: corpus file is empty")
    return records


def load_local(cfg: DataSettings) -> dict[str, Split]:
    files = {s: getattr(cfg.local, s) for s in SPLITS}
    if not files["validation"] or not files["test"]:
        # Only train given (or some splits missing): carve whole files/records out of train.
        docs = []
        for p in files["train"]:
            for i, r in enumerate(read_local_file(p, cfg.text_field)):
                docs.append((f"{p}#{i}", r))
        carved = split_documents(
            docs,
            cfg.validation_fraction,
            cfg.test_fraction,
            f"data.local.train {files['train']}",
        )
        out = {"train": carved["train"]}
        for s in ("validation", "test"):
            out[s] = (
                Split(
                    s,
                    [r for p in files[s] for r in read_local_file(p, cfg.text_field)],
                    str(files[s]),
                )
                if files[s]
                else carved[s]
            )
        return out
    return {
        s: Split(
            s, [r for p in files[s] for r in read_local_file(p, cfg.text_field)], str(files[s])
        )
        for s in SPLITS
    }


def load_hub(cfg: DataSettings) -> dict[str, Split]:
    """Load through `datasets.load_dataset`: a hub id, or a local folder laid out like one."""
    import datasets

    hub = cfg.hub
    where = f"data.hub {hub.path!r}" + (f" / {hub.name!r}" if hub.name else "")
    try:
        ds = datasets.load_dataset(hub.path, hub.name, revision=hub.revision)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise DistlmError(
            f"{where}: could not load the dataset ({type(e).__name__}: {e}). Offline? Set "
            "HF_DATASETS_OFFLINE=1 with a cached copy, or use data.source local"
        ) from None
    out = {}
    for s in SPLITS:
        name = getattr(hub.splits, s)
        if name not in ds:
            raise DistlmError(f"{where}: no split {name!r} (data.hub.splits.{s}); has {list(ds)}")
        if cfg.text_field not in ds[name].column_names:
            raise DistlmError(
                f"{where}: split {name!r} has no column {cfg.text_field!r} (data.text_field)"
            )
        out[s] = Split(s, list(ds[name][cfg.text_field]), f"{where} split {name!r}")
    return out


def load_splits(cfg: DataSettings) -> dict[str, Split]:
    src = cfg.source
    if src == "embedded":
        splits = split_documents(
            load_embedded(), cfg.validation_fraction, cfg.test_fraction, "pydoc_data.topics"
        )
    elif src == "local":
        splits = load_local(cfg)
    elif src == "hub":
        splits = load_hub(cfg)
    else:  # the schema rules this out
        raise DistlmError(f"data.source: unknown source {src!r}")
    for s in splits.values():
        if s.documents == 0:
            raise DistlmError(f"data split {s.name!r} is empty ({s.origin})")
    return splits


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int, out_dir: Path):
    """A byte-level BPE (GPT-2's scheme) trained on the train split, saved in HF format."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    tok.save_pretrained(out_dir)
    return tok


def model_tokenizer(model_cfg: ModelSourceSettings):
    """The model's own tokenizer (hub id or local folder), or None for a random init."""
    from transformers import AutoTokenizer

    if model_cfg.source == "init":
        return None
    name = model_cfg.name
    local = model_cfg.source == "local"
    if not name:  # Settings refuses this
        raise DistlmError(f"model.name: required when model.source is {model_cfg.source}")
    if local and not Path(name).is_dir():
        raise DistlmError(f"model.name: model folder not found: {name}")
    try:
        return AutoTokenizer.from_pretrained(
            name, revision=model_cfg.revision, local_files_only=local
        )
    except Exception as e:
        raise DistlmError(
            f"model.name {name!r}: could not load its tokenizer ({type(e).__name__}: {e}). "
            + ("" if local else "Unknown model id, or offline without a cached copy?")
        ) from None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise DistlmError(
            f"tokenizer folder {path} cannot be loaded ({type(e).__name__}: {e})"
        ) from None


def encode(tok, split: Split, separator: str, *, show: bool = True) -> np.ndarray:
    """Token ids of the split's records joined by `separator` (tokenized record by record)."""
    pieces = [r + separator for r in split.records[:-1]] + split.records[-1:]
    ids: list[np.ndarray] = []
    batch = 256
    bar = progress(
        range(0, len(pieces), batch), enabled=show, desc=f"tokenize {split.name}", unit="batch"
    )
    for i in bar:
        enc = tok(pieces[i : i + batch], add_special_tokens=False)["input_ids"]
        ids.extend(np.asarray(e, dtype=np.int64) for e in enc if len(e))
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------- HDF5


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def write_tokens(
    path: Path, streams: dict[str, np.ndarray], block_size: int, vocab_size: int, meta: dict
):
    dtype = token_dtype(vocab_size)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["block_size"] = block_size
        f.attrs["vocab_size"] = vocab_size
        f.attrs["meta"] = json.dumps(meta, sort_keys=True)
        for name, ids in streams.items():
            n_blocks = len(ids) // block_size
            g = f.create_group(name)
            g.attrs["n_tokens"] = len(ids)
            g.attrs["n_blocks"] = n_blocks
            g.create_dataset(
                "tokens",
                data=ids.astype(dtype),
                chunks=(min(len(ids), 1 << 16),),
                compression=None,
            )
            rows = max(1, min(n_blocks, (1 << 16) // block_size))
            g.create_dataset(
                "blocks",
                data=ids[: n_blocks * block_size].astype(dtype).reshape(n_blocks, block_size),
                chunks=(rows, block_size),
            )


class TokenBlocks:
    """Random access to one split's blocks, read from disk on demand (open lazily, per process).

    blocks = TokenBlocks("results/data/tokens.h5", "train")
    x = blocks[[3, 17, 42]]   # (3, block_size) int64, only those rows read
    """

    def __init__(self, path: str | Path, split: str) -> None:
        self.path = Path(path)
        self.split = split
        self._file: h5py.File | None = None
        with h5py.File(self.path, "r") as f:
            check_tokens_file(f, self.path)
            if split not in f:
                raise DistlmError(f"{self.path}: no split {split!r}")
            self.block_size = int(f.attrs["block_size"])
            self.vocab_size = int(f.attrs["vocab_size"])
            self.n_blocks = int(f[split]["blocks"].shape[0])
            self.n_tokens = int(f[split]["tokens"].shape[0])

    def __len__(self) -> int:
        return self.n_blocks

    def _blocks(self) -> h5py.Dataset:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
            # cached: the group lookup costs ~100x a row read (training reads rows every step)
            self._ds = self._file[self.split]["blocks"]
        return self._ds

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, (int, np.integer)):
            return self._blocks()[int(idx)].astype(np.int64)
        idx = np.asarray(idx, dtype=np.int64)
        order = np.argsort(idx)  # h5py wants increasing indices
        rows = self._blocks()[idx[order]]
        out = np.empty_like(rows, dtype=np.int64)
        out[order] = rows
        return out

    def tokens(self) -> np.ndarray:
        """The split's whole token stream (for sliding-window evaluation)."""
        with h5py.File(self.path, "r") as f:
            return f[self.split]["tokens"][:].astype(np.int64)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self):  # picklable for DataLoader workers: reopen in the child
        state = self.__dict__.copy()
        state["_file"] = None
        state.pop("_ds", None)
        return state


def check_tokens_file(f: h5py.File, path: Path) -> None:
    if f.attrs.get("format") != FORMAT:
        raise DistlmError(f"{path}: not a distlm token file (format {f.attrs.get('format')!r})")


def read_tokens_meta(path: str | Path) -> dict:
    try:
        with h5py.File(path, "r") as f:
            check_tokens_file(f, Path(path))
            return json.loads(f.attrs["meta"])
    except OSError as e:
        raise DistlmError(f"{path}: cannot read token file ({e})") from None


# ----------------------------------------------------------------------------- stage


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
    write_tokens(Path(tokens_path), streams, bs, vocab_size, meta)
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
