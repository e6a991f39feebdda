"""Documents between stages and messages between ranks: the base of every named, versioned type
(pydantic), its one writer and its one reader. Each document type lives with the stage that
writes it, in that home's light `documents.py` (data/, model/, transfer/, broadcast/, train/,
evaluate/, inference/: no torch imported for them), or as its package's messages.

    write_document(path, doc)                  # atomically, with its "format" tag first
    doc = read_document(path, EvalReport)      # refuses another kind or version, naming the file
    blob = encode(msg); msg = decode(blob, TransferStats)   # the same, for messages between ranks

Each type carries `KIND` and `VERSION`; the JSON holds `"format": "<kind>/<version>"`. A reader
refuses a document of another kind or version, and a malformed one, with an error that names the
file and the field. Unknown fields are refused too: a writer that adds a field bumps the version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
)

from distlm import DistlmError
from distlm.core.io import write_json

D = TypeVar("D", bound="Document")


class DocumentError(DistlmError):
    """A document or message is missing, of another kind or version, or malformed."""


class Document(BaseModel):
    """Base of every document and message: strict fields, a kind and a version."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str]
    VERSION: ClassVar[int]

    @classmethod
    def tag(cls) -> str:
        return f"{cls.KIND}/{cls.VERSION}"

    def to_json(self) -> dict:
        return {"format": self.tag(), **self.model_dump(mode="json")}

    @classmethod
    def from_json(cls, obj: object, where: str) -> Self:
        """Check the format tag, then every field; errors name `where` and the field."""
        if not isinstance(obj, dict):
            raise DocumentError(f"{where}: expected a {cls.tag()} object, got {type(obj).__name__}")
        found = obj.get("format")
        if found != cls.tag():
            what = "no format tag" if found is None else f"a {found!r} document"
            raise DocumentError(
                f"{where}: {what} where {cls.tag()!r} ({cls.__name__}) was expected"
                + (
                    "; it was written by another version of distlm: rerun the stage that wrote it"
                    if isinstance(found, str) and found.split("/")[0] == cls.KIND
                    else ""
                )
            )
        body = {k: v for k, v in obj.items() if k != "format"}
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "<top level>"
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            raise DocumentError(
                f"{where}: malformed {cls.__name__}: field {field}: {err['msg']}{more}"
            ) from None


def write_document(path: str | os.PathLike, doc: Document) -> None:
    """Write `doc` atomically (distlm.core.io) with its format tag."""
    write_json(path, doc.to_json())


def read_document(path: str | os.PathLike, cls: type[D], *, untagged: bool = False) -> D:
    """Read a `cls` document, refusing another kind or version and malformed fields.

    `untagged`: a file without a format tag is read as this version of `cls`. Only for the files
    distlm wrote, with these very fields, before the type carried its tag (a checkpoint's
    state.json, a run folder's identity.json): results of that release read unchanged."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DocumentError(f"{cls.__name__} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DocumentError(f"{path}: malformed {cls.__name__}: not valid JSON ({e})") from None
    if untagged and isinstance(obj, dict) and "format" not in obj:
        obj = {"format": cls.tag(), **obj}
    return cls.from_json(obj, str(path))


def encode(msg: Document) -> bytes:
    """A message between ranks, as bytes."""
    return json.dumps(msg.to_json(), separators=(",", ":")).encode()


def decode(blob: bytes, cls: type[D], where: str) -> D:
    """A message from bytes; `where` names the sender in errors."""
    try:
        obj = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DocumentError(f"{where}: not a {cls.tag()} message ({e})") from None
    return cls.from_json(obj, where)


# ----------------------------------------------------------------------------- parts of documents

Number = int | float


class Part(BaseModel):
    """A part of a document: strict fields, frozen (a document's sections)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
