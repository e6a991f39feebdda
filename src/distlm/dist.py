"""Process-group topology: decided once, then asked questions of.

    with distributed(backend="gloo", timeout_s=120) as topo:
        if topo.is_main: ...

Works under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set) and as a single plain process
(world size 1, no process group needed but one is still created so collectives work uniformly).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.device import DeviceBackend, is_gpu
from distlm.lifeline import bind_to_launcher
from distlm.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: rank, world size, node-local rank, the process group's backend,
    and the device backend it computes with (distlm.device: device, precision, kernels)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # the process group's: gloo or nccl
    device_backend: DeviceBackend

    @property
    def device(self) -> torch.device:
        return self.device_backend.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if dist.is_initialized():
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def check_backend(backend: str, device: torch.device) -> None:
    if backend == "nccl" and not is_gpu(device):
        raise DistlmError("config runtime.backend is 'nccl' but the device is the CPU; use gloo")
    if backend == "nccl" and not dist.is_nccl_available():
        raise DistlmError("config runtime.backend is 'nccl' but this torch build has no NCCL")
    if backend == "gloo" and not dist.is_gloo_available():
        raise DistlmError("config runtime.backend is 'gloo' but this torch build has no gloo")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def distributed(
    *,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 120.0,
    ranks_key: str = "the stage's rank count",
    precision: str = "fp32",
    precision_key: str = "precision",
    compile: bool = False,
) -> Iterator[Topology]:
    """Initialise the default process group from the torchrun environment; always tear it down.

    Outside torchrun (no RANK in the environment) this is a world of one on a private port.
    A rank started by a launcher is bound to it first (distlm.lifeline): it dies with it. The
    device backend (distlm.device) is decided before the group starts: a node with fewer GPUs
    than ranks is refused naming `ranks_key`, a precision its GPU lacks naming `precision_key`.
    """
    bind_to_launcher()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
    hw = DeviceBackend.for_rank(
        device,
        local_rank=local_rank,
        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE") or 1),
        ranks_key=ranks_key,
        precision=precision,
        precision_key=precision_key,
        compile=compile,
    )
    dev = hw.device
    check_backend(backend, dev)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = dev
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if restart != "0":
        # A torchrun restart reuses the agent's store, which still holds the failed attempt's keys
        # (gloo/NCCL peer addresses): without a fresh prefix the new workers dial dead ones.
        use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # TCPStore and PrefixStore are public (documented) but not in torch.distributed's __all__
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=rank == 0 and not use_agent,
            timeout=_dt.timedelta(seconds=timeout_s),
        )
        kwargs["store"] = dist.PrefixStore(  # pyright: ignore[reportPrivateImportUsage]
            f"distlm/attempt-{restart}", store
        )
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world,
        timeout=_dt.timedelta(seconds=timeout_s),
        **kwargs,
    )
    hw.share_threads()
    topo = Topology(
        rank=rank, world_size=world, local_rank=local_rank, backend=backend, device_backend=hw
    )
    log.info("process group up: rank %d of %d, backend %s, %s", rank, world, backend, hw.describe())
    try:
        yield topo
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
