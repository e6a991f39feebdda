"""The HDF5 token file: per split the whole token stream and its blocks (N x block_size,
chunked by rows); writing it, reading blocks (`TokenBlocks`) and its metadata, format checked."""

from __future__ import annotations

import json
from io import BytesIO
from pathlib import Path

import h5py
import numpy as np

from distlm import DistlmError
from distlm.core.io import atomic_path
from distlm.core.log import get_logger
from distlm.data.documents import TokenMeta

log = get_logger(__name__)


FORMAT = TokenMeta.tag()  # the file's `format` attribute: its metadata document's tag


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def write_tokens(
    path: Path, streams: dict[str, np.ndarray], block_size: int, vocab_size: int, meta: TokenMeta
):
    dtype = token_dtype(vocab_size)
    item = np.dtype(dtype).itemsize
    size = sum((len(ids) + len(ids) // block_size * block_size) * item for ids in streams.values())
    # Built in memory (the streams are there already), then written with one plain write: HDF5
    # writing onto a full disk crashes the process in close() (a segfault, not an error), while a
    # plain write raises ENOSPC, which distlm.core.io turns into DiskFull with the file left as it was.
    image = BytesIO()
    with h5py.File(image, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["block_size"] = block_size
        f.attrs["vocab_size"] = vocab_size
        body = meta.model_dump(mode="json")
        f.attrs["meta"] = json.dumps(body, sort_keys=True)
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
    with atomic_path(path, size=size) as tmp:
        tmp.write_bytes(image.getbuffer())


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
            self.block_size = _int_attr(f, self.path, "block_size")
            self.vocab_size = _int_attr(f, self.path, "vocab_size")
            self.n_blocks = int(_dataset(f, self.path, split, "blocks").shape[0])
            self.n_tokens = int(_dataset(f, self.path, split, "tokens").shape[0])

    def __len__(self) -> int:
        return self.n_blocks

    def _blocks(self) -> h5py.Dataset:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
            # cached: the group lookup costs ~100x a row read (training reads rows every step)
            self._ds = _dataset(self._file, self.path, self.split, "blocks")
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
            return _dataset(f, self.path, self.split, "tokens")[:].astype(np.int64)

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
    found = f.attrs.get("format")
    if found != FORMAT:
        other = isinstance(found, str) and found.split("/")[0] == TokenMeta.KIND
        raise DistlmError(
            f"{path}: not a distlm token file of format {FORMAT!r} (format {found!r})"
            + (
                "; it was written by another version of distlm: rerun the data stage"
                if other
                else ""
            )
        )


def _dataset(f: h5py.File, path: Path, split: str, name: str) -> h5py.Dataset:
    node = f.get(f"{split}/{name}")
    if not isinstance(node, h5py.Dataset):
        raise DistlmError(f"{path}: {split}/{name} is not a dataset ({type(node).__name__})")
    return node


def _int_attr(f: h5py.File, path: Path, name: str) -> int:
    value = f.attrs.get(name)
    if not isinstance(value, (int, np.integer)):
        raise DistlmError(f"{path}: attribute {name!r} is {value!r}, not an integer")
    return int(value)


def read_tokens_meta(path: str | Path) -> TokenMeta:
    """The token file's metadata document; another format or a malformed body names the file."""
    try:
        with h5py.File(path, "r") as f:
            check_tokens_file(f, Path(path))
            meta = f.attrs.get("meta")
            if not isinstance(meta, str):
                raise DistlmError(f"{path}: attribute 'meta' is {meta!r}, not a JSON string")
            try:
                body = json.loads(meta)
            except json.JSONDecodeError as e:
                raise DistlmError(f"{path}: attribute 'meta' is not valid JSON ({e})") from None
    except OSError as e:
        raise DistlmError(f"{path}: cannot read token file ({e})") from None
    if not isinstance(body, dict):
        raise DistlmError(f"{path}: attribute 'meta' is not a JSON object")
    return TokenMeta.from_json({"format": FORMAT, **body}, f"{path} (attribute 'meta')")
