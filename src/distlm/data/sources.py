"""Corpus sources (`data.source`): the embedded CPython docs, a hub dataset, local files; each
gives train/validation/test `Split`s of documents, with errors that name the file or dataset."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.settings import DataSettings

log = get_logger(__name__)


SPLITS = ("train", "validation", "test")
EOS = "<|endoftext|>"


@dataclass
class Split:
    """The records of one split and where they came from (for error messages)."""

    name: str
    records: list[str] = field(default_factory=list)
    origin: str = ""

    @property
    def documents(self) -> int:
        return sum(1 for r in self.records if r.strip())


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
