"""Data planes: what carries the bulk bytes of the buckets. Choose or add a transport here.

A plane posts sends and receives of byte views (`isend`, `irecv`, `wait`); `zero_copy` says whether
it may send from and receive into the tensors' own memory. "torch" is torch.distributed
point-to-point (NCCL or gloo) on the control link; "uccl" is in distlm.transfer.uccl.
"""

from __future__ import annotations

import torch

from distlm.transfer.link import Link
from distlm.transfer.options import TRANSPORTS, TransferError
from distlm.transfer.uccl import UcclPlane, check_uccl


class TorchPlane:
    """Bulk data over torch.distributed point-to-point (NCCL or gloo), straight from the given views."""

    name = "torch"
    zero_copy = True  # chunks inside one tensor are sent from / received into the tensor itself

    def __init__(self, link: Link) -> None:
        self.link = link

    def setup(self, buffers: list[torch.Tensor], prev: int | None, nxt: int | None) -> None:
        pass

    def isend(self, view: torch.Tensor, peer: int, what: str):
        return self.link.isend(view, peer, what)

    def irecv(self, view: torch.Tensor, peer: int, what: str):
        return self.link.irecv(view, peer, what)

    def wait(self, handle) -> None:
        self.link.wait(handle)

    def close(self) -> None:
        pass


def check_transport(transport: str, device: torch.device, backend: str) -> None:
    """Raise TransferError saying why `transport` cannot run here; never substitutes another."""
    if transport == "torch":
        if backend == "nccl" and device.type != "cuda":
            raise TransferError(
                f"transport torch with backend nccl needs CUDA tensors, these are on {device}"
            )
        if backend == "gloo" and device.type != "cpu":
            raise TransferError(
                f"transport torch with backend gloo moves CPU tensors; these are on {device} (use nccl)"
            )
        return
    if transport == "uccl":
        check_uccl(device)
        return
    raise TransferError(f"unknown transport {transport!r} ({', '.join(TRANSPORTS)})")


def make_plane(transport: str, link: Link, **kw):
    if transport == "torch":
        return TorchPlane(link)
    return UcclPlane(link, **kw)
