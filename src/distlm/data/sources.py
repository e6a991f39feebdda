"""Corpus sources (`data.source`): the records of one shard's source, streamed, and the split
each goes to; errors name the file and the record.

    for split, text in records(source, progress=bar.update):   # one record at a time
        ...

A unit (distlm.data.documents.Unit) is read as a stream whatever its size: a .jsonl's lines from
its byte range (a line belongs to the range its first byte is in), a .parquet's row groups in
batches, a .txt whole (a file is one document), the embedded corpus (CPython's reference
documentation, `pydoc_data.topics`, 79 topics) whole. A hub data file is read by the same readers
through fsspec (`hf://` URLs; huggingface_hub's file system), a local copy laid out like the hub
as local files.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from distlm import DistlmError
from distlm.data.documents import Carve, Source, SplitName, Unit

EOS = "<|endoftext|>"
EMBEDDED = "pydoc_data.topics"
FORMATS = {".txt": "txt", ".text": "txt", ".md": "txt", ".raw": "txt"}
FORMATS |= {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_BATCH_ROWS = 1024  # parquet rows read at a time


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


def rank_split(
    docs: Sequence[tuple[str, str]], validation_fraction: float, test_fraction: float, origin: str
) -> dict[str, SplitName]:
    """The embedded corpus's rule, name -> split: whole documents dealt out by the rank of a hash
    of their name (the first `validation_fraction` of them validation, then test)."""
    ordered = sorted(name for name, _ in docs)
    ordered.sort(key=lambda name: hashlib.sha256(name.encode()).hexdigest())
    n = len(ordered)
    n_val = max(1, round(validation_fraction * n)) if validation_fraction > 0 else 0
    n_test = max(1, round(test_fraction * n)) if test_fraction > 0 else 0
    if n - n_val - n_test < 1:
        raise DistlmError(
            f"{origin}: {n} documents cannot be split into train/validation/test "
            f"(validation_fraction={validation_fraction}, test_fraction={test_fraction})"
        )
    return {
        name: "validation" if i < n_val else "test" if i < n_val + n_test else "train"
        for i, name in enumerate(ordered)
    }


def hash_split(text: str, carve: Carve) -> SplitName:
    """The split of a document by a hash of its text (rule `hash`): validation when its share in
    [0, 1) is below carve.validation, test below validation + test, else train. A document's
    split is its own: adding files moves no other document, and a copy of it lands beside it."""
    share = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
    if share < carve.validation:
        return "validation"
    if share < carve.validation + carve.test:
        return "test"
    return "train"


# ----------------------------------------------------------------------------- listing files


def expand(entries: Sequence[str], key: str) -> list[str]:
    """The files of a `data.local.<split>` list: each entry a file or a glob (sorted); an entry
    that names nothing is refused, naming the key."""
    out: list[str] = []
    for entry in entries:
        if glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not found:
                raise DistlmError(f"{key}: {entry!r} matches no file")
            out += found
        elif not os.path.isfile(entry):
            raise DistlmError(f"{key}: corpus file not found: {entry}")
        else:
            out.append(entry)
    return out


def file_format(path: str) -> str:
    suffix = os.path.splitext(path.split("?")[0])[1].lower()
    if suffix not in FORMATS:
        raise DistlmError(
            f"{path}: unknown corpus format {suffix!r} (use .txt, .jsonl, .json or .parquet)"
        )
    return FORMATS[suffix]


@contextlib.contextmanager
def open_file(path: str) -> Iterator[IO[bytes]]:
    """A corpus file for reading, local or remote (a hub data file's `hf://` URL, through fsspec);
    an error names the file."""
    try:
        if "://" in path:
            import fsspec

            with fsspec.open(path, "rb") as f:
                yield f  # pyright: ignore[reportReturnType]
        else:
            with open(path, "rb") as f:
                yield f
    except (OSError, ValueError) as e:
        if isinstance(e, DistlmError):
            raise
        raise DistlmError(f"{path}: cannot read the corpus file ({type(e).__name__}: {e})") from e


def file_size(path: str) -> int:
    if "://" in path:
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        return int(fs.size(inner))
    return os.path.getsize(path)


def parquet_groups(path: str, text_field: str) -> list[int]:
    """The text bytes of each row group of a .parquet (its footer alone is read)."""
    import pyarrow.parquet as pq

    with open_file(path) as f:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as e:  # pyarrow raises ArrowInvalid and others for a broken file
            raise DistlmError(f"{path}: not a readable parquet file ({e})") from None
        names = [meta.schema.column(i).path for i in range(meta.num_columns)]
        if text_field not in names:
            raise DistlmError(
                f"{path}: no column {text_field!r} (data.text_field); columns: {names}"
            )
        col = names.index(text_field)
        return [
            meta.row_group(g).column(col).total_uncompressed_size
            for g in range(meta.num_row_groups)
        ]


# ----------------------------------------------------------------------------- reading records


def records(
    source: Source, *, progress: Callable[[int], object] | None = None
) -> Iterator[tuple[SplitName, str]]:
    """(split, text) of every record of `source`, in order; `progress(n)` is told of every n
    bytes of text read."""
    tell = progress or (lambda n: None)
    for unit in source.units:
        if unit.format == "embedded":
            yield from _embedded(source, tell)
            continue
        reader = {"txt": _txt, "jsonl": _jsonl, "parquet": _parquet}[unit.format]
        for text in reader(unit, source.text_field, tell):
            if source.split is not None:
                yield source.split, text
            else:
                assert source.carve is not None  # the plan gives one or the other
                yield hash_split(text, source.carve), text


def _embedded(source: Source, tell: Callable[[int], object]) -> Iterator[tuple[SplitName, str]]:
    docs = load_embedded()
    carve = source.carve
    assert carve is not None and carve.rule == "name_rank"
    split_of = rank_split(docs, carve.validation, carve.test, EMBEDDED)
    for name, text in docs:
        tell(len(text.encode("utf-8")))
        yield split_of[name], text


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DistlmError(f"{where}: not UTF-8 text ({e})") from None


def _txt(unit: Unit, text_field: str, tell: Callable[[int], object]) -> Iterator[str]:
    with open_file(unit.file) as f:
        data = f.read()
    tell(len(data))
    yield _decode(data, unit.file)


def _line_number(path: str, offset: int) -> int:
    """The line of a byte offset (counted only for an error message)."""
    n = 1
    with open_file(path) as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def _jsonl(unit: Unit, text_field: str, tell: Callable[[int], object]) -> Iterator[str]:
    path = unit.file
    with open_file(path) as f:
        pos = unit.start
        if (
            pos > 0
        ):  # the line the range starts in belongs to the range before, unless it starts here
            f.seek(pos - 1)
            if f.read(1) != b"\n":
                pos += len(f.readline())
        else:
            f.seek(0)
        while pos < unit.stop:
            line = f.readline()
            if not line:
                break
            start, pos = pos, pos + len(line)
            tell(len(line))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                where = f"{path}:{_line_number(path, start)}"
                if isinstance(e, UnicodeDecodeError):
                    raise DistlmError(f"{where}: not UTF-8 text ({e})") from None
                raise DistlmError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or text_field not in obj or obj[text_field] is None:
                where = f"{path}:{_line_number(path, start)}"
                raise DistlmError(f"{where}: no field {text_field!r} (data.text_field)")
            yield str(obj[text_field])


def _parquet(unit: Unit, text_field: str, tell: Callable[[int], object]) -> Iterator[str]:
    import pyarrow.parquet as pq

    path = unit.file
    with open_file(path) as f:
        try:
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise DistlmError(
                    f"{path}: no column {text_field!r} (data.text_field); "
                    f"columns: {pf.schema_arrow.names}"
                )
            row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
            batches = pf.iter_batches(
                batch_size=_BATCH_ROWS,
                row_groups=list(range(unit.start, unit.stop)),
                columns=[text_field],
            )
            for batch in batches:
                texts = batch.column(0).to_pylist()
                for i, text in enumerate(texts):
                    if text is None:
                        raise DistlmError(
                            f"{path}: row {row + i}: no value in column {text_field!r} "
                            "(data.text_field)"
                        )
                    if not isinstance(text, str):
                        raise DistlmError(
                            f"{path}: row {row + i}: column {text_field!r} holds "
                            f"{type(text).__name__}, not text"
                        )
                    tell(len(text.encode("utf-8")))
                    yield text
                row += len(texts)
        except DistlmError:
            raise
        except Exception as e:  # pyarrow's errors for a broken file
            raise DistlmError(f"{path}: not a readable parquet file ({e})") from None
