"""The control link: point-to-point tensors and byte messages among a transfer's peers.

Every wait is bounded by `timeout_s`; a failed or timed-out operation goes to the `Watch`, which
names the rank that stopped before raising.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, NamedTuple

import torch

from distlm.core.documents import Document, encode
from distlm.transfer.errors import TransferError
from distlm.transfer.messages import M, read_message
from distlm.transfer.peers import Peers
from distlm.transfer.watch import Watch

MAX_MESSAGE_BYTES = 256 * 2**20  # a control message's length above this is refused, not allocated


class Pending(NamedTuple):
    """A posted send or receive: what to wait on, and what to name when it fails."""

    work: Any
    peer: int
    what: str


class Link:
    """Point-to-point messages among `peers`, each wait bounded by timeout_s."""

    def __init__(self, peers: Peers, device: torch.device, timeout_s: float, watch: Watch) -> None:
        self.peers = peers
        self.device = device  # where control tensors live (cuda for NCCL)
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.watch = watch
        self._tags: dict[tuple[str, int], int] = {}

    def _tag(self, kind: str, peer: int) -> int:
        n = self._tags.get((kind, peer), 0)
        self._tags[(kind, peer)] = n + 1
        return n % (2**31)

    def isend(self, t: torch.Tensor, peer: int, what: str):
        try:
            work = self.peers.isend(t, peer, self._tag("out", peer))
        except Exception as e:
            self.watch.fail(peer, f"sending {what}", e)
        return Pending(work, peer, f"sending {what}")

    def irecv(self, t: torch.Tensor, peer: int, what: str):
        try:
            work = self.peers.irecv(t, peer, self._tag("in", peer))
        except Exception as e:
            self.watch.fail(peer, f"receiving {what}", e)
        return Pending(work, peer, f"receiving {what}")

    def wait(self, handle: Pending) -> None:
        work, peer, what = handle
        try:
            work.wait(self.timeout)
        except Exception as e:
            self.watch.fail(peer, what, e)

    def send_bytes(self, blob: bytes, peer: int, what: str) -> None:
        n = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        self.wait(self.isend(n, peer, f"{what} (length)"))
        if blob:
            payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
            self.wait(self.isend(payload, peer, what))

    def recv_bytes(self, peer: int, what: str) -> bytes:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.wait(self.irecv(n, peer, f"{what} (length)"))
        size = int(n.item())
        if not 0 <= size <= MAX_MESSAGE_BYTES:
            raise TransferError(
                f"rank {peer} announced a {size}-byte {what}; "
                f"control messages are at most {MAX_MESSAGE_BYTES} bytes"
            )
        if size == 0:
            return b""
        payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.wait(self.irecv(payload, peer, what))
        return payload.cpu().numpy().tobytes()

    def send_message(self, msg: Document, peer: int, what: str) -> None:
        """A typed, versioned message (distlm.transfer.messages) to `peer`."""
        self.send_bytes(encode(msg), peer, what)

    def recv_message(self, peer: int, cls: type[M], what: str) -> M:
        """A `cls` message from `peer`; another kind or version is refused, naming the sender."""
        return read_message(self.recv_bytes(peer, what), cls, peer)
