"""Weights for a model that is already running, from a folder (a live update of the server:
distlm.inference.engine.update): which safetensors files hold which tensors, the sha256 each file
must have, and the digest that names the weights.

Three folders hold a model's weights, each with the sha256 of its files in a document:
- a model folder: distlm.json's model_sha256 names model.safetensors (and is the digest);
- a pipeline folder: shards/manifest.json names each stage shard's sha256 (model_sha256, the
  source model file's, is the digest);
- a training checkpoint of the whole kind (`ddp`): checkpoint.json names model.safetensors'
  sha256 (the digest). A sharded (`fsdp`) checkpoint holds torch.distributed.checkpoint shards,
  not safetensors: it is refused, naming the run's final folder as the way.

`weight_files` reads the documents and the files' headers (names, shapes), nothing more;
`read_tensors` reads some tensors (one pipeline stage's): every file that holds one of them is
hashed first, through the same open file it is then read from, so a file replaced after the check
(distlm writes by rename) cannot slip other bytes in.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.core.documents import read_document
from distlm.family import ModelArgs
from distlm.model.documents import CheckpointIndex, ModelMeta, ShardManifest
from distlm.model.folder import read_args
from distlm.model.layout import CONFIG, MANIFEST, META, SHARDS, WEIGHTS

CHECKPOINT_INDEX = "checkpoint.json"
_HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Header:
    """One tensor as a safetensors header describes it: its name there, dtype, shape, and its
    byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class WeightFiles:
    """A folder's weights: `files` (safetensors path -> the sha256 its document names),
    `tensors` (transformers' name -> the file holding it, and its header), `digest` (what names
    the weights: the answers' system_fingerprint), `config` (a config.json whose architecture must
    be the running model's; a checkpoint has none: its tensor names and shapes are checked)."""

    folder: str
    kind: str  # "model folder", "pipeline folder" or "training checkpoint"
    digest: str
    files: dict[str, str]
    tensors: dict[str, tuple[str, Header]]
    config: str | None

    @property
    def nbytes(self) -> int:
        return sum(h.end - h.start for _, h in self.tensors.values())

    def held(self, names: Iterable[str], tied: Mapping[str, str]) -> dict[str, tuple[str, Header]]:
        """Where each of `names` is held: (file, header); a tied copy (`tied`: copy -> its
        source, the last stage's head) by its source when the folder has no copy of its own.
        A name held nowhere is missing: the error names it."""
        out = {}
        for name in names:
            held = self.tensors.get(name) or self.tensors.get(tied.get(name, ""))
            if held is None:
                raise DistlmError(
                    f"{self.folder}: tensor {name!r} of the running model is missing ({self.kind})"
                )
            out[name] = held
        return out

    def check_names(self, expected: Iterable[str], tied: Mapping[str, str]) -> None:
        """Every tensor of the running model (`expected`: every stage's names) is here and
        nothing else is; the error names the tensor (each stage checks its tensors' shapes as it
        stages them)."""
        expected = set(expected)
        self.held(sorted(expected), tied)
        extra = sorted(set(self.tensors) - expected - set(tied.values()))
        if extra:
            raise DistlmError(
                f"{self.folder}: tensor {extra[0]!r} is no part of the running model "
                f"({len(extra)} such; another architecture?)"
            )


def weight_files(folder: str | Path) -> WeightFiles:
    """What a folder holds of a model's weights (see the module doc); DistlmError naming the
    file for a folder that is none of the three, a document that does not read, or a file whose
    header is not a safetensors header."""
    path = Path(folder)
    if not path.is_absolute():
        raise DistlmError(f"{folder}: not an absolute path (the server's stages read it)")
    if not path.is_dir():
        raise DistlmError(f"{folder}: no such folder")
    if (path / SHARDS / MANIFEST).is_file():
        manifest = read_document(path / SHARDS / MANIFEST, ShardManifest)
        files = {str(path / SHARDS / s.file): s.sha256 for s in manifest.shards}
        return _of(path, "pipeline folder", manifest.model_sha256, files, path / CONFIG)
    if (path / CHECKPOINT_INDEX).is_file():
        index = read_document(path / CHECKPOINT_INDEX, CheckpointIndex)
        if any(f.startswith(SHARDS + "/") for f in index.sha256):
            raise DistlmError(
                f"{path}: a sharded (fsdp) training checkpoint: its weights are "
                "torch.distributed.checkpoint shards, not safetensors; update from the run's "
                "final folder (results/train/final), or push from the training ranks"
            )
        if WEIGHTS not in index.sha256:
            raise DistlmError(f"{path / CHECKPOINT_INDEX}: names no {WEIGHTS}")
        sha = index.sha256[WEIGHTS]
        return _of(path, "training checkpoint", sha, {str(path / WEIGHTS): sha}, None)
    if (path / META).is_file():
        meta = read_document(path / META, ModelMeta)
        files = {str(path / WEIGHTS): meta.model_sha256}
        return _of(path, "model folder", meta.model_sha256, files, path / CONFIG)
    raise DistlmError(
        f"{path}: not a model folder ({META}), a pipeline folder ({SHARDS}/{MANIFEST}) or a "
        f"training checkpoint ({CHECKPOINT_INDEX})"
    )


def _of(
    path: Path, kind: str, digest: str, files: dict[str, str], config: Path | None
) -> WeightFiles:
    tensors: dict[str, tuple[str, Header]] = {}
    for f in files:
        with _open(f) as fd:
            for name, h in _header(fd, f).items():
                if name in tensors:
                    raise DistlmError(f"{f}: tensor {name!r} is also in {tensors[name][0]}")
                tensors[name] = (f, h)
    if config is not None and not config.is_file():
        raise DistlmError(f"model config not found: {config}")
    return WeightFiles(
        str(path), kind, digest, files, tensors, None if config is None else str(config)
    )


def _open(f: str):
    """A weights file, opened to read; only a regular file (a FIFO or a device named by a
    hostile document would block, or never end)."""
    try:
        if not stat.S_ISREG(os.stat(f).st_mode):
            raise DistlmError(f"{f}: not a regular file")
        return open(f, "rb")
    except FileNotFoundError:
        raise DistlmError(f"{f}: weights file not found (named by its folder's document)") from None
    except OSError as e:
        raise DistlmError(f"{f}: cannot read: {e.strerror}") from None


def _header(fd, f: str) -> dict[str, Header]:
    """The tensors a safetensors file holds (its header: 8 bytes of length, then JSON)."""
    head = os.pread(fd.fileno(), 8, 0)
    size = os.fstat(fd.fileno()).st_size
    if len(head) < 8:
        raise DistlmError(f"{f}: not a safetensors file (shorter than its header)")
    (n,) = struct.unpack("<Q", head)
    if n > min(_HEADER_MAX, size - 8):
        raise DistlmError(f"{f}: not a safetensors file (a header of {n} bytes)")
    try:
        doc = json.loads(os.pread(fd.fileno(), n, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DistlmError(f"{f}: not a safetensors file (its header: {e})") from None
    if not isinstance(doc, dict):
        raise DistlmError(f"{f}: not a safetensors file (its header is no JSON object)")
    out = {}
    base = 8 + n
    for name, d in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
        except (TypeError, KeyError, ValueError) as err:
            raise DistlmError(f"{f}: tensor {name!r}: a bad header entry ({err})") from None
        if dtype not in _DTYPES:
            raise DistlmError(f"{f}: tensor {name!r}: dtype {dtype!r} is not a weight's")
        count = 1
        for s in shape:
            count *= s
        if not (0 <= b <= e and base + e <= size and e - b == count * _itemsize(dtype)):
            raise DistlmError(f"{f}: tensor {name!r}: its bytes lie outside the file (truncated?)")
        out[str(name)] = Header(str(name), dtype, shape, base + b, base + e)
    return out


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def read_tensors(
    src: WeightFiles, names: Iterable[str], tied: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """The tensors `names` (transformers' names: one pipeline stage's; a tied copy read from its
    source), in host memory. Every file that holds one is checked against its sha256 first,
    through the open file it is then read from."""
    want = {n: (f, h.name) for n, (f, h) in src.held(names, tied).items()}  # (file, its name)
    out: dict[str, torch.Tensor] = {}
    for f in sorted({f for f, _ in want.values()}):
        with _open(f) as fd:
            _check(fd, f, src.files[f])
            heads = _header(fd, f)  # read again: the file checked is the file read
            for name, (g, held) in want.items():
                if g != f:
                    continue
                if held not in heads:
                    raise DistlmError(f"{f}: tensor {held!r} is gone from the file")
                h = heads[held]
                buf = bytearray(h.end - h.start)
                if os.preadv(fd.fileno(), [buf], h.start) != len(buf):
                    raise DistlmError(f"{f}: tensor {held!r}: the file ended early")
                dtype = _DTYPES[h.dtype]
                t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                out[name] = t.reshape(h.shape)
    return out


def _check(fd, f: str, expected: str) -> None:
    sha = hashlib.sha256()
    off = 0
    while block := os.pread(fd.fileno(), 8 << 20, off):
        sha.update(block)
        off += len(block)
    if sha.hexdigest() != expected:
        raise DistlmError(
            f"{f}: sha256 {sha.hexdigest()} does not match {expected}, which its folder's "
            "document names (changed after it was written?)"
        )


def args_of(src: WeightFiles) -> ModelArgs | None:
    """The architecture the folder's config.json describes (None for a checkpoint, which has
    none: its tensors' names and shapes are checked instead)."""
    return None if src.config is None else read_args(Path(src.config).parent)
