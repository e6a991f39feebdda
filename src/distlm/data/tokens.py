"""The token store in HDF5: shard files, the index over them, and reading a split's blocks.

    results/data/shards/<id>.h5   one per tokenize job: per split `tokens` (every record followed
                                  by the separator) and `last` (the last record alone), both
                                  contiguous datasets of the token dtype, so a reader maps them
                                  into memory; its `meta` attribute is a ShardMeta
    results/data/tokens.h5        the index: per split `tokens`, an HDF5 virtual dataset that
                                  strings the shards' streams together (any HDF5 tool reads it as
                                  one dataset), and the TokenMeta

A split's stream is its shards' `tokens` in plan order, the last one's without its last record's
separator, then that shard's `last`: the records joined by the separator, as one process would
tokenize them. Its block i is tokens [i * block_size, (i + 1) * block_size) of the stream.

A shard is written without a whole-shard array: ids stream into a scratch file per split with
plain writes (a full disk is an error, distlm.core.io.DiskFull), then HDF5 writes only the file's
skeleton, with the datasets' space allocated and unfilled, and the ids are copied into place.

    blocks = TokenBlocks("results/data/tokens.h5", "train")
    x = blocks[[3, 17, 42]]   # (3, block_size) int64, read from the shards' memory maps

A token file of version 1 (the release before: one file, each split's stream and blocks in it)
reads the same way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Self, TypeVar

import h5py
import numpy as np

from distlm import DistlmError
from distlm.core.io import (
    DiskFull,
    atomic_path,
    free_bytes,
    full_disk_error,
    new_temp_file,
    remove_leftovers,
)
from distlm.core.log import get_logger
from distlm.data.documents import SPLITS, ShardMeta, SplitName, TokenMeta

log = get_logger(__name__)

FORMAT = TokenMeta.tag()  # the index's `format` attribute: its metadata document's tag
FORMAT_V1 = f"{TokenMeta.KIND}/1"  # the release before's one-file token store
SHARD_FORMAT = ShardMeta.tag()
_COPY = 8 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype ids are stored in: uint16 up to 65,536 ids, else uint32 (little-endian)."""
    return np.dtype("<u2" if vocab_size <= np.iinfo(np.uint16).max + 1 else "<u4")


# ----------------------------------------------------------------------------- writing a shard


class _Short(Exception):
    """Too little space for a shard file, found before HDF5 writes a byte of it."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class ShardWriter:
    """A shard file written as its ids are made: `add(split, ids)` appends to the split's
    stream (scratch files), `finish(meta, last)` writes the file (atomically) and returns it.

        with ShardWriter(path, dtype) as w:
            w.add("train", ids)
            w.finish(meta, {"train": last_ids, ...})
    """

    def __init__(self, path: str | os.PathLike, dtype: np.dtype) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.counts: dict[SplitName, int] = {s: 0 for s in SPLITS}
        self._files: dict[SplitName, BinaryIO] = {}
        self._scratch: list[Path] = []

    def __enter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.path.parent, self.path.name)  # a killed writer's scratch files
        try:
            for s in SPLITS:
                fd, tmp = new_temp_file(self.path)  # named as a leftover of this writer
                self._scratch.append(tmp)
                self._files[s] = os.fdopen(fd, "w+b")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, kind, e, tb) -> None:
        """The scratch files go, whatever happened; a full disk is a DiskFull naming the shard,
        with the bytes its streams had written."""
        written = sum(p.stat().st_size for p in self._scratch if p.exists())
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        for p in self._scratch:
            p.unlink(missing_ok=True)
        self._files.clear()
        self._scratch.clear()
        if isinstance(e, _Short):
            reason, free = os.strerror(errno.ENOSPC), free_bytes(self.path.parent)
            raise DiskFull(self.path, reason=reason, needed=e.need, estimated=True, free=free)
        if isinstance(e, Exception) and not isinstance(e, DiskFull):
            full = full_disk_error(e, self.path, written=written)
            if full is not None:
                raise full from e

    def add(self, split: SplitName, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype)
        self._files[split].write(data.tobytes())
        self.counts[split] += len(data)

    def finish(self, meta: ShardMeta, last: Mapping[SplitName, np.ndarray]) -> None:
        """Write the shard file from the streams added and each split's `last` ids."""
        sizes = {(s, "tokens"): self.counts[s] for s in SPLITS}
        sizes |= {(s, "last"): len(last[s]) for s in SPLITS}
        need = sum(sizes.values()) * self.dtype.itemsize + (64 << 10)  # + the skeleton
        # HDF5 writing onto a full disk crashes the process in close() (a segfault, not an error):
        # it only writes the skeleton below, once this much is known to be free
        if free_bytes(self.path.parent) < need:  # the whole write: the streams and the file
            raise _Short(need + sum(self.counts.values()) * self.dtype.itemsize)
        with atomic_path(self.path, size=need) as tmp:
            offsets = _skeleton(tmp, meta, sizes, self.dtype)
            with open(tmp, "r+b") as out:
                for s in SPLITS:
                    src = self._files[s]
                    src.flush()
                    src.seek(0)
                    out.seek(offsets[(s, "tokens")])
                    while block := src.read(_COPY):
                        out.write(block)
                    out.seek(offsets[(s, "last")])
                    out.write(np.ascontiguousarray(last[s], self.dtype).tobytes())
                out.flush()


def _untimed() -> h5py.h5p.PropDCID:
    """A dataset's creation properties without its creation and modification times: the same
    tokens give the same file, byte for byte."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    return dcpl


def _skeleton(
    path: Path, meta: ShardMeta, sizes: Mapping[tuple[str, str], int], dtype: np.dtype
) -> dict[tuple[str, str], int]:
    """The shard file's HDF5 structure with every dataset's space allocated and left unwritten;
    returns where each dataset's bytes go."""
    offsets: dict[tuple[str, str], int] = {}
    with h5py.File(path, "w") as f:
        f.attrs["format"] = SHARD_FORMAT
        f.attrs["meta"] = json.dumps(meta.model_dump(mode="json"), sort_keys=True)
        for (split, name), n in sizes.items():
            g = f.require_group(split)
            dcpl = _untimed()
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dsid = h5py.h5d.create(
                g.id,
                name.encode(),
                h5py.h5t.py_create(dtype),
                h5py.h5s.create_simple((n,), (n,)),
                dcpl=dcpl,
            )
            offsets[(split, name)] = dsid.get_offset() if n else 0
    return offsets


# ----------------------------------------------------------------------------- reading a shard


def read_shard_meta(path: str | os.PathLike) -> ShardMeta:
    """A shard file's metadata; a missing, unreadable or foreign file is named."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as f:
            return _shard_meta(f, path)
    except OSError as e:
        raise DistlmError(f"{path}: cannot read the token shard ({e})") from None


def _shard_meta(f: h5py.File, path: Path) -> ShardMeta:
    found = f.attrs.get("format")
    if found != SHARD_FORMAT:
        raise DistlmError(
            f"{path}: not a distlm token shard of format {SHARD_FORMAT!r} ({found!r})"
        )
    return _meta_attr(f, path, ShardMeta)


D = TypeVar("D", ShardMeta, TokenMeta)


def _meta_attr(f: h5py.File, path: Path, cls: type[D]) -> D:
    """The document in a file's `meta` attribute (its `format` attribute checked already)."""
    meta = f.attrs.get("meta")
    if not isinstance(meta, str):
        raise DistlmError(f"{path}: attribute 'meta' is {meta!r}, not a JSON string")
    try:
        body = json.loads(meta)
    except json.JSONDecodeError as e:
        raise DistlmError(f"{path}: attribute 'meta' is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise DistlmError(f"{path}: attribute 'meta' is not a JSON object")
    return cls.from_json({"format": cls.tag(), **body}, f"{path} (attribute 'meta')")


def _mapped(path: Path, name: str) -> np.ndarray:
    """A contiguous dataset of a shard file mapped into memory (read-only)."""
    try:
        with h5py.File(path, "r") as f:
            ds = f.get(name)
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 1:
                raise DistlmError(f"{path}: {name} is not a 1-D dataset")
            n, dtype = ds.shape[0], ds.dtype
            offset = ds.id.get_offset() if n else None
            if n and (offset is None or ds.chunks is not None or ds.compression is not None):
                raise DistlmError(f"{path}: {name} is not a contiguous dataset")
    except OSError as e:
        raise DistlmError(f"{path}: cannot read the token shard ({e})") from None
    if not n or offset is None:
        return np.zeros(0, dtype=dtype)
    end = offset + n * dtype.itemsize
    if os.path.getsize(path) < end:
        raise DistlmError(f"{path}: truncated: {name} ends at byte {end}, beyond the file's end")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))


# ----------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class Segment:
    """A run of a split's stream: tokens [start, stop) of dataset `name` of a shard file."""

    file: Path
    name: str  # "<split>/tokens" or "<split>/last"
    start: int
    stop: int


def stream_segments(shards: Sequence[tuple[Path, ShardMeta]], split: SplitName) -> list[Segment]:
    """The segments of `split`'s stream over the shards (in plan order) that hold some of it."""
    holding = [(p, m.splits[split]) for p, m in shards if m.splits[split].records]
    segs: list[Segment] = []
    for i, (path, part) in enumerate(holding):
        if i < len(holding) - 1:
            segs.append(Segment(path, f"{split}/tokens", 0, part.tokens))
        else:
            segs.append(Segment(path, f"{split}/tokens", 0, part.tokens - part.last_piece))
            segs.append(Segment(path, f"{split}/last", 0, part.last))
    return [s for s in segs if s.stop > s.start]


def write_index(
    path: str | os.PathLike,
    streams: Mapping[str, Sequence[Segment]],
    *,
    meta: TokenMeta,
    dtype: np.dtype,
) -> None:
    """The index file: per split a virtual dataset over its segments (paths relative to the
    index's folder, so a moved results folder reads), the metadata document in its attributes."""
    path = Path(path)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["block_size"] = meta.block_size
        f.attrs["vocab_size"] = meta.vocab_size
        f.attrs["meta"] = json.dumps(meta.model_dump(mode="json"), sort_keys=True)
        for split, segs in streams.items():
            n = sum(s.stop - s.start for s in segs)
            dcpl = _untimed()
            dcpl.set_fill_value(np.zeros(1, dtype=dtype))
            at = 0
            sizes: dict[tuple[Path, str], int] = {}
            for s in segs:
                if (s.file, s.name) not in sizes:
                    with h5py.File(s.file, "r") as sf:
                        sizes[(s.file, s.name)] = int(sf[s.name].shape[0])  # pyright: ignore[reportAttributeAccessIssue]
                vspace = h5py.h5s.create_simple((n,))
                vspace.select_hyperslab((at,), (s.stop - s.start,))
                src = h5py.h5s.create_simple((sizes[(s.file, s.name)],))
                src.select_hyperslab((s.start,), (s.stop - s.start,))
                rel = os.path.relpath(s.file, path.parent)
                dcpl.set_virtual(vspace, rel.encode(), s.name.encode(), src)
                at += s.stop - s.start
            g = f.create_group(split)
            space = h5py.h5s.create_simple((n,))
            h5py.h5d.create(g.id, b"tokens", h5py.h5t.py_create(dtype), space, dcpl=dcpl)
            g.attrs["n_tokens"] = n
            g.attrs["n_blocks"] = n // meta.block_size


def check_tokens_file(f: h5py.File, path: Path) -> str:
    """The token file's format tag (this version's or the release before's), else an error."""
    found = f.attrs.get("format")
    if found not in (FORMAT, FORMAT_V1):
        other = isinstance(found, str) and found.split("/")[0] == TokenMeta.KIND
        raise DistlmError(
            f"{path}: not a distlm token file of format {FORMAT!r} (format {found!r})"
            + (
                "; it was written by another version of distlm: rerun the data stage"
                if other
                else ""
            )
        )
    return str(found)


def _int_attr(f: h5py.File, path: Path, name: str) -> int:
    value = f.attrs.get(name)
    if not isinstance(value, (int, np.integer)):
        raise DistlmError(f"{path}: attribute {name!r} is {value!r}, not an integer")
    return int(value)


def read_tokens_meta(path: str | os.PathLike) -> TokenMeta:
    """The token file's metadata document; another format or a malformed body names the file."""
    try:
        with h5py.File(path, "r") as f:
            check_tokens_file(f, Path(path))
            return _meta_attr(f, Path(path), TokenMeta)
    except OSError as e:
        raise DistlmError(f"{path}: cannot read token file ({e})") from None


def index_shards(path: str | os.PathLike) -> list[Path]:
    """The shard files an index strings together, in plan order (empty for a version-1 file)."""
    path = Path(path)
    files: dict[Path, None] = {}
    with h5py.File(path, "r") as f:
        if check_tokens_file(f, path) == FORMAT_V1:
            return []
        for split in SPLITS:
            ds = f.get(f"{split}/tokens")
            if isinstance(ds, h5py.Dataset) and ds.is_virtual:
                for m in ds.virtual_sources():
                    files[(path.parent / m.file_name).resolve()] = None
    return list(files)


def _made_from(path: str | os.PathLike, config_digest: str) -> str | None:
    """The format of token file `path` when it is there and was made from the data config of
    `config_digest` (written atomically: one that is there is whole), else None."""
    if not Path(path).is_file():
        return None
    try:
        with h5py.File(path, "r") as f:
            found = check_tokens_file(f, Path(path))
        meta = read_tokens_meta(path)
    except (DistlmError, OSError):
        return None
    return found if meta.config_digest == config_digest else None


def finished_v1(path: str | os.PathLike, config_digest: str) -> bool:
    """Whether `path` is a token file of the release before made from this data config."""
    return _made_from(path, config_digest) == FORMAT_V1


def finished_shards(path: str | os.PathLike, config_digest: str) -> tuple[str, list] | None:
    """(tokenizer id, shard specs) of a finished index made from this data config whose shard
    files are all there, else None."""
    if _made_from(path, config_digest) != FORMAT:
        return None
    try:
        specs = [read_shard_meta(p).spec for p in index_shards(path)]
    except DistlmError:
        return None
    if not specs:
        return None
    return specs[0].tokenizer, specs


# ----------------------------------------------------------------------------- reading blocks


class TokenBlocks:
    """Random access to one split's stream and blocks, read from the shards' memory maps (opened
    lazily, per process).

    blocks = TokenBlocks("results/data/tokens.h5", "train")
    x = blocks[[3, 17, 42]]   # (3, block_size) int64, only those rows read
    """

    def __init__(self, path: str | os.PathLike, split: str) -> None:
        self.path = Path(path)
        self.split = split
        self._arrays: list[np.ndarray | h5py.Dataset] | None = None
        self._h5: h5py.File | None = None
        try:
            with h5py.File(self.path, "r") as f:
                self.format = check_tokens_file(f, self.path)
                if split not in f:
                    raise DistlmError(f"{self.path}: no split {split!r}")
                self.block_size = _int_attr(f, self.path, "block_size")
                self.vocab_size = _int_attr(f, self.path, "vocab_size")
                ds = f.get(f"{split}/tokens")
                if not isinstance(ds, h5py.Dataset):
                    raise DistlmError(f"{self.path}: {split}/tokens is not a dataset")
                self.n_tokens = int(ds.shape[0])
                self._segments = self._layout(ds)
        except OSError as e:
            raise DistlmError(f"{self.path}: cannot read token file ({e})") from None
        self.n_blocks = self.n_tokens // self.block_size
        self._starts = np.array([s[0] for s in self._segments] + [self.n_tokens], dtype=np.int64)

    def _layout(self, ds: h5py.Dataset) -> list[tuple[int, Path | None, str, int, int]]:
        """(stream offset, shard file or None for this file, dataset, start, stop) per run."""
        if self.format == FORMAT_V1:
            return [(0, None, f"{self.split}/tokens", 0, self.n_tokens)]
        if not ds.is_virtual:
            raise DistlmError(f"{self.path}: {self.split}/tokens is not a virtual dataset")
        runs = []
        for m in ds.virtual_sources():
            (v0,), (v1,) = m.vspace.get_select_bounds()
            (s0,), (s1,) = m.src_space.get_select_bounds()
            runs.append(
                (int(v0), self.path.parent / m.file_name, m.dset_name, int(s0), int(s1) + 1)
            )
            if v1 - v0 != s1 - s0:
                raise DistlmError(f"{self.path}: {self.split}/tokens maps runs of unequal length")
        runs.sort()
        return runs

    def _open(self) -> list[np.ndarray | h5py.Dataset]:
        if self._arrays is None:
            arrays: list[np.ndarray | h5py.Dataset] = []
            for _, file, name, start, stop in self._segments:
                if file is None:  # version 1: this file's own (chunked) dataset
                    if self._h5 is None:
                        self._h5 = h5py.File(self.path, "r")
                    ds = self._h5[name]
                    assert isinstance(ds, h5py.Dataset)
                    arrays.append(ds)
                    continue
                mapped = _mapped(file, name)
                if stop > len(mapped):
                    raise DistlmError(
                        f"{file}: {name} has {len(mapped)} tokens; the index {self.path} "
                        f"reads up to {stop}"
                    )
                arrays.append(mapped[start:stop])
            self._arrays = arrays
        return self._arrays

    def __len__(self) -> int:
        return self.n_blocks

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the stream, int64 (into `out` when given)."""
        arrays = self._open()
        if out is None:
            out = np.empty(stop - start, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        at = 0
        while start < stop:
            seg_start = int(self._starts[i])
            seg_stop = int(self._starts[i + 1])
            take = min(stop, seg_stop) - start
            out[at : at + take] = arrays[i][start - seg_start : start - seg_start + take]
            at += take
            start += take
            i += 1
        return out

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Blocks `idx` (any order), as an (n, block_size) int64 array."""
        bs = self.block_size
        out = np.empty((len(idx), bs), dtype=np.int64)
        for j, i in enumerate(np.asarray(idx, dtype=np.int64)):
            if not 0 <= i < self.n_blocks:
                raise IndexError(f"block {i} of {self.n_blocks} ({self.path} {self.split})")
            self.read(int(i) * bs, int(i + 1) * bs, out[j])
        return out

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, (int, np.integer)):
            return self.rows(np.array([idx]))[0]
        return self.rows(np.asarray(idx, dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """The split's whole token stream (for sliding-window evaluation)."""
        return self.read(0, self.n_tokens)

    def close(self) -> None:
        self._arrays = None
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None

    def __getstate__(self):  # picklable for DataLoader workers: reopen in the child
        state = self.__dict__.copy()
        state["_arrays"] = None
        state["_h5"] = None
        return state
