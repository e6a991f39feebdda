"""The broadcast stage's report (results/broadcast/report.json: `BroadcastReport`)."""

from __future__ import annotations

from typing import ClassVar

from distlm.core.documents import Document
from distlm.transfer.documents import TransferStats


class BroadcastReport(Document):
    """results/broadcast/report.json: the broadcast stage's run, the sender's view."""

    KIND: ClassVar[str] = "distlm-broadcast"
    VERSION: ClassVar[int] = 2
    model: str
    model_sha256: str | None
    world_size: int
    receivers_configured: int
    bucket_mb: float
    chunk_mb: float
    timeout_s: float
    config_digest: str | None
    stats: TransferStats
