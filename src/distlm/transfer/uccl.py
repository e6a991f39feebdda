"""The `uccl` data plane: bucket chunks over UCCL's P2P engine (`uccl.p2p`, pinned to 0.1.1).

Only the bulk bytes travel over UCCL; metadata, checksums and reports stay on torch.distributed.
Per rank: one `p2p.Endpoint` on the rank's GPU; its metadata goes into the torch.distributed store;
each rank connects to its successor in the chain (`ep.connect(ip, gpu_bdf, port)` from
`Endpoint.parse_metadata`) and accepts its predecessor (`ep.accept()`); both bucket buffers are
registered once (`ep.reg(ptr, size)`), then chunks move with the two-sided `send_async` /
`recv_async(conn_id, mr_id, ptr, size)` and are polled with `poll_async(transfer_id)`.
Two-sided send/recv exist in 0.1.1 and were removed later, hence the exact pin.

`check_uccl` refuses, saying why, wherever this cannot run: Python < 3.12 (0.1.1 ships cp312 wheels
only), `uccl.p2p` missing or failing to import, another uccl version, no CUDA tensors, or no RDMA
NIC while UCCL_P2P_TRANSPORT does not select the NCCL/TCP data plane.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar, NoReturn

import torch

from distlm.core.log import get_logger
from distlm.runtime.device import gpu_index, gpu_problem, stream_synchronize
from distlm.transfer.errors import TransferError

log = get_logger(__name__)

UCCL_VERSION = "0.1.1"
_FALLBACK_TRANSPORTS = ("tcp", "nccl")  # UCCL_P2P_TRANSPORT values that need no RDMA NIC


def _import_p2p():
    # uccl/__init__.py swallows import errors of p2p, so import the submodule explicitly.
    import uccl  # pyright: ignore[reportMissingImports]
    from uccl import p2p  # pyright: ignore[reportMissingImports, reportAttributeAccessIssue]

    return uccl, p2p


def uccl_problems(device: torch.device) -> list[str]:
    """Every reason the uccl transport cannot run here (empty: it can)."""
    problems = []
    if sys.version_info < (3, 12):
        problems.append(
            f"Python {sys.version.split()[0]}: uccl {UCCL_VERSION} ships cp312 wheels only (needs Python >= 3.12)"
        )
    else:
        try:
            uccl, _ = _import_p2p()
            version = getattr(uccl, "__version__", "unknown")
            if version != UCCL_VERSION:
                problems.append(
                    f"uccl {version} is installed; distlm speaks the {UCCL_VERSION} P2P API "
                    f"(two-sided send/recv, removed later): pip install 'uccl=={UCCL_VERSION}'"
                )
        except Exception as e:  # ImportError, or a missing CUDA/RDMA library behind it
            problems.append(
                f"`from uccl import p2p` failed ({type(e).__name__}: {e}); pip install 'distlm[uccl]'"
            )
    gpu = gpu_problem(device)
    if gpu:
        problems.append(f"{gpu}: the uccl transport moves CUDA tensors (uccl.p2p.Endpoint)")
    transport = os.environ.get("UCCL_P2P_TRANSPORT", "ib")
    ib = Path("/sys/class/infiniband")
    has_nic = ib.is_dir() and any(ib.iterdir())
    if transport not in _FALLBACK_TRANSPORTS and not has_nic:
        problems.append(
            f"no RDMA NIC ({ib} is empty or absent) for UCCL_P2P_TRANSPORT={transport}; "
            f"set UCCL_P2P_TRANSPORT to one of {', '.join(_FALLBACK_TRANSPORTS)} for UCCL's NCCL/TCP data plane"
        )
    return problems


def check_uccl(device: torch.device) -> None:
    problems = uccl_problems(device)
    if problems:
        raise TransferError(
            "transfer.transport 'uccl' cannot run here:\n  " + "\n  ".join(problems)
        )


class UcclPlane:
    """Chunks of the registered bucket buffers over UCCL P2P connections along the chain."""

    # Only the registered bucket buffers travel: every chunk is packed.
    zero_copy: ClassVar[bool] = False

    def __init__(
        self, link, *, store, prefix: str, rank: int, device: torch.device, timeout_s: float
    ) -> None:
        if store is None:
            raise TransferError(
                "the uccl transport needs the torch.distributed store to exchange endpoints"
            )
        _, self.p2p = _import_p2p()
        self.link, self.store, self.prefix, self.rank = link, store, prefix, rank
        self.timeout_s = timeout_s
        self.device = device
        self.ep = self.p2p.Endpoint(gpu_index(device))
        self.store.set(f"{prefix}/uccl/{rank}", self.ep.get_metadata())
        self.mrs: list[int] = []
        self.conn: dict[int, int] = {}

    def _fail(self, what: str, peer: int | None = None) -> NoReturn:
        where = f" with rank {peer}" if peer is not None else ""
        raise TransferError(f"rank {self.rank}: uccl {what}{where} failed")

    def setup(self, buffers: list[torch.Tensor], prev: int | None, nxt: int | None) -> None:
        self.buffers = buffers
        accepted: list = []
        acceptor = None
        if (
            prev is not None
        ):  # accept the predecessor while connecting to the successor: no deadlock
            acceptor = threading.Thread(
                target=lambda: accepted.append(self.ep.accept()), daemon=True
            )
            acceptor.start()
        if nxt is not None:
            self.store.wait([f"{self.prefix}/uccl/{nxt}"])
            ip, port, gpu_bdf = self.p2p.Endpoint.parse_metadata(
                self.store.get(f"{self.prefix}/uccl/{nxt}")
            )
            ok, conn_id = self.ep.connect(ip, gpu_bdf, port)
            if not ok:
                self._fail(f"connect to {ip}:{port}", nxt)
            self.conn[nxt] = conn_id
        if acceptor is not None and prev is not None:
            acceptor.join(self.timeout_s)
            if not accepted or not accepted[0][0]:
                self._fail("accept", prev)
            self.conn[prev] = accepted[0][3]
        for buf in buffers:
            ok, mr_id = self.ep.reg(buf.data_ptr(), buf.numel())
            if not ok:
                self._fail(f"registering a {buf.numel()}-byte bucket buffer")
            self.mrs.append(mr_id)
        log.info(
            "uccl endpoints up: connections %s, %d buffers registered", self.conn, len(self.mrs)
        )

    def _mr(self, view: torch.Tensor) -> int:
        ptr = view.data_ptr()
        for buf, mr in zip(self.buffers, self.mrs):
            if buf.data_ptr() <= ptr and ptr + view.numel() <= buf.data_ptr() + buf.numel():
                return mr
        raise ValueError("chunk outside the registered bucket buffers")  # zero_copy is off: never

    def _xfer(self, op: str, view: torch.Tensor, peer: int, what: str):
        if view.numel() == 0:
            return None
        # The chunk must be in device memory before UCCL reads it (packing ran on the stream).
        stream_synchronize(self.device)
        fn = self.ep.send_async if op == "send" else self.ep.recv_async
        ok, xfer_id = fn(self.conn[peer], self._mr(view), view.data_ptr(), view.numel())
        if not ok:
            self._fail(f"{op} of {what}", peer)
        return (xfer_id, peer, what)

    def isend(self, view: torch.Tensor, peer: int, what: str):
        return self._xfer("send", view, peer, f"sending {what}")

    def irecv(self, view: torch.Tensor, peer: int, what: str):
        return self._xfer("recv", view, peer, f"receiving {what}")

    def wait(self, handle) -> None:
        if handle is None:
            return
        xfer_id, peer, what = handle
        deadline = time.monotonic() + self.timeout_s
        while True:
            ok, done = self.ep.poll_async(xfer_id)
            if not ok:
                self.link.watch.fail(peer, what, RuntimeError("uccl poll_async reported an error"))
            if done:
                return
            if time.monotonic() > deadline:
                self.link.watch.fail(
                    peer, what, TimeoutError(f"timed out after {self.timeout_s} s")
                )
            time.sleep(0)

    def close(self) -> None:
        for mr in self.mrs:
            try:
                self.ep.dereg(mr)
            except Exception:
                pass
        self.mrs = []
