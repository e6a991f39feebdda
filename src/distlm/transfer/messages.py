"""The messages ranks exchange during a transfer: named, versioned types with typed fields.

    plan       sender -> receivers (relayed down the chain)   PlanMessage
    check      each receiver -> sender                        MetadataCheck
    go / stop  sender -> each receiver                        MetadataVerdict
    report     each receiver -> sender                        TransferStats (distlm.core.documents)
    verdict    sender -> each receiver                        TransferVerdict

Each travels as a `distlm.core.documents` message (`{"format": "<kind>/<version>", ...}`) over the
control link; `read_message` refuses another kind or version, naming the sender, since every rank
of a transfer must run the same distlm. The bulk bytes and the checksums are raw tensors.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from distlm.core.documents import Document, DocumentError
from distlm.transfer.errors import TransferError
from distlm.transfer.plan import Entry, Plan, dtype_of

M = TypeVar("M", bound=Document)


class PlanEntry(BaseModel):
    """One tensor of the plan on the wire (see `plan.Entry`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    shape: list[int] = Field(description="the tensor's shape")
    dtype: str = Field(description="torch dtype name without the 'torch.' prefix")
    start: int = Field(ge=0, description="byte offset in the stream")
    nbytes: int = Field(ge=0)
    alias: str | None = Field(description="the tensor it shares storage with (sent once)")


class PlanMessage(Document):
    """The sender's plan: every tensor's place in the byte stream, and the bucket and chunk sizes."""

    KIND: ClassVar[str] = "distlm-transfer-plan"
    VERSION: ClassVar[int] = 1
    stream_bytes: int = Field(ge=0)
    bucket_bytes: int = Field(gt=0)
    chunk_bytes: int = Field(gt=0)
    entries: list[PlanEntry]

    @classmethod
    def of(cls, plan: Plan) -> PlanMessage:
        return cls(
            stream_bytes=plan.stream_bytes,
            bucket_bytes=plan.bucket_bytes,
            chunk_bytes=plan.chunk_bytes,
            entries=[
                PlanEntry(
                    name=e.name,
                    shape=list(e.shape),
                    dtype=e.dtype,
                    start=e.start,
                    nbytes=e.nbytes,
                    alias=e.alias,
                )
                for e in plan.entries
            ],
        )

    def to_plan(self) -> Plan:
        """The plan, after checking that its entries describe one consistent byte stream."""
        seen: set[str] = set()
        for e in self.entries:
            n = math.prod(e.shape) * dtype_of(e.dtype).itemsize
            if e.name in seen:
                raise TransferError(f"plan: tensor {e.name!r} appears twice")
            if min(e.shape, default=0) < 0 or n != e.nbytes:
                raise TransferError(
                    f"plan: tensor {e.name!r} is {e.nbytes} bytes for shape {e.shape} {e.dtype}"
                )
            if e.alias is not None and e.alias not in seen:
                raise TransferError(f"plan: tensor {e.name!r} aliases unknown {e.alias!r}")
            if e.start + e.nbytes > self.stream_bytes:
                raise TransferError(f"plan: tensor {e.name!r} ends past the stream")
            seen.add(e.name)
        entries = tuple(
            Entry(e.name, tuple(e.shape), e.dtype, e.start, e.nbytes, e.alias) for e in self.entries
        )
        return Plan(entries, self.stream_bytes, self.bucket_bytes, self.chunk_bytes)


class MetadataCheck(Document):
    """A receiver's answer to the plan: what does not match its template (empty: all does)."""

    KIND: ClassVar[str] = "distlm-transfer-metadata-check"
    VERSION: ClassVar[int] = 1
    problems: list[str]


class MetadataVerdict(Document):
    """The source's word to every receiver after the checks: the problems by rank (none: go)."""

    KIND: ClassVar[str] = "distlm-transfer-metadata-verdict"
    VERSION: ClassVar[int] = 1
    problems: dict[int, list[str]]


class TransferVerdict(Document):
    """The source's word to every receiver at the end: did every receiver verify."""

    KIND: ClassVar[str] = "distlm-transfer-verdict"
    VERSION: ClassVar[int] = 1
    ok: bool
    error: str


def read_message(blob: bytes, cls: type[M], sender: int) -> M:
    """A `cls` message from rank `sender`; another kind or version, or a bad field, is refused."""
    try:
        obj = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TransferError(
            f"rank {sender} sent a {cls.tag()} message that is not JSON ({e})"
        ) from None
    found = obj.get("format") if isinstance(obj, dict) else None
    if found != cls.tag():
        raise TransferError(
            f"rank {sender} sent a {found!r} message where {cls.tag()!r} ({cls.__name__}) was "
            "expected: every rank of a transfer must run the same distlm version"
        )
    try:
        return cls.from_json(obj, f"rank {sender}")
    except DocumentError as e:
        raise TransferError(str(e)) from None
