"""Data planes: what carries the bulk bytes of the buckets. Add a transport here (and choose it in
`TransferSession.start`).

A plane posts sends and receives of byte views (`isend`, `irecv`, `wait`); `zero_copy` says whether
it may send from and receive into the tensors' own memory. "torch" is torch.distributed
point-to-point (NCCL or gloo) on the control link; "uccl" is in distlm.transfer.uccl.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, get_args

import torch

from distlm.runtime.device import backend_problem
from distlm.settings import TransferSettings
from distlm.transfer.errors import TransferError
from distlm.transfer.link import Link
from distlm.transfer.uccl import check_uccl

TRANSPORTS: tuple[str, ...] = get_args(TransferSettings.model_fields["transport"].annotation)


class Plane(Protocol):
    """What the bucket stream asks of a transport."""

    zero_copy: ClassVar[bool]  # may send from / receive into the tensors' own memory

    def setup(self, buffers: list[torch.Tensor], prev: int | None, nxt: int | None) -> None: ...
    def isend(self, view: torch.Tensor, peer: int, what: str) -> Any: ...
    def irecv(self, view: torch.Tensor, peer: int, what: str) -> Any: ...
    def wait(self, handle: Any) -> None: ...
    def close(self) -> None: ...


class TorchPlane:
    """Bulk data over torch.distributed point-to-point (NCCL or gloo), straight from the given views."""

    # Chunks inside one tensor are sent from / received into the tensor itself.
    zero_copy: ClassVar[bool] = True

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
        problem = backend_problem(backend, device)
        if problem:
            raise TransferError(f"transport torch: {problem}")
        return
    if transport == "uccl":
        check_uccl(device)
        return
    raise TransferError(f"unknown transport {transport!r} ({', '.join(TRANSPORTS)})")
