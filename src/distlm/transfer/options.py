"""What every rank passes to a transfer, and the error every rank raises when it fails."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from distlm import DistlmError

TRANSPORTS = ("torch", "uccl")


class TransferError(DistlmError):
    """A transfer failed: the message names the rank, tensor or bucket at fault."""


@dataclass(frozen=True)
class TransferOptions:
    """How to move the weights. Every rank of the group passes the same options."""

    transport: str = "torch"  # "torch" (NCCL/gloo point-to-point) or "uccl" (UCCL P2P engine)
    bucket_mb: float = 64  # flat bucket size; two buckets are allocated per rank
    chunk_mb: float = 4  # relay granularity along the chain; smaller = earlier forwarding
    timeout_s: float = 120  # longest wait for any single message before the peer is declared dead
    device: str | torch.device | None = None  # receivers without a template: where to allocate
    # Test hook, receivers only: called as hook(rank, bucket, chunk, data) after each chunk arrives
    # and before it is forwarded or checked; tests corrupt `data` or kill the process here.
    fault_hook: Callable[[int, int, int, torch.Tensor], None] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise TransferError(
                f"broadcast.transport: unknown transport {self.transport!r} ({', '.join(TRANSPORTS)})"
            )
        for name in ("bucket_mb", "chunk_mb", "timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise TransferError(f"broadcast.{name}: must be a positive number, got {v!r}")

    @classmethod
    def from_config(cls, section: Mapping[str, Any], **kw) -> TransferOptions:
        """From the config's `broadcast:` section (transport, bucket_mb, chunk_mb, timeout_s)."""
        keys = ("transport", "bucket_mb", "chunk_mb", "timeout_s")
        return cls(**{k: section[k] for k in keys if k in section}, **kw)
