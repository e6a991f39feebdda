"""TEMPORARY until distlm.settings lands (branch settings22): the four transfer settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distlm.transfer.errors import TRANSPORTS, TransferError


@dataclass(frozen=True)
class TransferSettings:
    transport: str = "torch"
    bucket_mb: float = 64
    chunk_mb: float = 4
    timeout_s: float = 120

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise TransferError(
                f"transfer.transport: unknown transport {self.transport!r} ({', '.join(TRANSPORTS)})"
            )
        for name in ("bucket_mb", "chunk_mb", "timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise TransferError(f"transfer.{name}: must be a positive number, got {v!r}")
