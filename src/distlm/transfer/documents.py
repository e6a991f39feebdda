"""What a weight transfer reports: each rank's figures (`TransferStats`, also each receiver's
report to the sender)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from distlm.core.documents import Document

# ----------------------------------------------------------------------------- weight broadcast


class ReceiverStats(BaseModel):
    """One receiver's figures, as the sender reports them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int
    seconds: float
    gbps: float | None
    verified: bool
    checksum_seconds: float
    unpack_seconds: float
    mismatches: list[str]


class TransferStats(Document):
    """One rank's figures of a `distlm.transfer` broadcast (also each receiver's report to the
    sender); on the sender `receivers` lists every receiver and `seconds` runs until the last
    one has verified."""

    KIND: ClassVar[str] = "distlm-transfer-stats"
    VERSION: ClassVar[int] = 1
    rank: int
    role: Literal["sender", "receiver"]
    transport: str
    backend: str
    device: str
    src: int
    chain: list[int]
    bytes: int
    stream_bytes: int
    tensors: int
    tied_tensors: int
    buckets: int
    bucket_bytes: int
    chunk_bytes: int
    metadata_seconds: float
    seconds: float
    gbps: float | None
    pack_seconds: float = 0.0
    checksum_seconds: float = 0.0
    unpack_seconds: float = 0.0
    packed_bytes: int = 0
    verified: bool | None
    mismatches: list[str]
    all_verified: bool | None = None
    receivers: list[ReceiverStats] = Field(default_factory=list)
