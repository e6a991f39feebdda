"""The ranks and the machine: one `Topology` per process, decided once, then asked questions of.

    with distributed(backend="gloo", timeout_s=120) as topo:   # a torch.distributed stage
        if topo.is_main: ...
    Topology(rank, world_size, local_rank, MPI_RING, hw, local_world_size=...)   # a pipeline stage

Every stage's ranks are described by it: the torch.distributed stages' (broadcast, train, eval:
a process group over gloo or nccl) and the inference pipeline's (MPI, a ring: `next`, `prev`,
`is_last`; distlm.inference.engine). It holds the rank's device backend (distlm.runtime.device: device,
precision, autocast, synchronisation, events, graphs) and shares the host's threads among the
ranks on it (`share_threads`).

`distributed()` works under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set) and as a single
plain process (world size 1, no process group needed but one is still created so collectives
work uniformly).
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
from distlm.core.log import get_logger
from distlm.runtime.device import DeviceBackend, is_gpu
from distlm.runtime.host import threads_per_rank, usable_cpus
from distlm.runtime.lifeline import bind_to_launcher

log = get_logger(__name__)

MPI_RING = (
    "mpi"  # `Topology.backend` of the inference pipeline's ranks: an MPI job, not a torch group
)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank among `world_size`, its place among the
    `local_world_size` ranks on its host, how the ranks talk (`backend`: gloo or nccl, a
    torch.distributed process group; MPI_RING, the pipeline's ring over MPI), and the device
    backend it computes with (distlm.runtime.device: device, precision, autocast, synchronisation, graphs)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # gloo or nccl (a torch.distributed process group), or MPI_RING (the pipeline)
    device_backend: DeviceBackend
    local_world_size: int = 1

    @classmethod
    def single(cls, hw: DeviceBackend | None = None, backend: str = "gloo") -> Topology:
        """A world of one rank (the CPU's by default), for a process that runs alone."""
        return cls(0, 1, 0, backend, hw or DeviceBackend.cpu())

    @property
    def device(self) -> torch.device:
        return self.device_backend.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # -- the pipeline's ring: rank r sends to r + 1, the last rank back to rank 0 ------------
    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world_size

    def device_mesh(self):
        """These ranks as a 1-D device mesh over the world's process group, on this rank's device
        type: what a sharded layout shards over (distlm.train.parallel). Given to FSDP2 always,
        which would otherwise take the accelerator's default mesh: a gloo/CPU run on a host that
        has GPUs would move its parameters to CUDA."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,))

    def barrier(self) -> None:
        if dist.is_initialized():
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def share_threads(self) -> int:
        """Give this rank its share of its host's thread budget; return its intra-op threads.

        Snakemake sets OMP_NUM_THREADS to the rule's `threads`, a total for the job, and both
        launchers pass it on to every rank: 2 ranks x 2 threads on 2 cores oversubscribe the cores
        (slower steps, with spikes: benchmarks/LOG.md). Under torchrun it is a ceiling a rank (torchrun's meaning: it
        sets 1 itself when it starts several ranks), and a GPU rank keeps torch's own count; under
        mpiexec (the pipeline, which sets none) it is the job's budget, shared by the ranks on
        this host (`distlm.runtime.host.threads_per_rank`); serve's API server processes beside
        stage 0 take no share of it (`distlm.inference.engine.bootstrap.mpi_pipeline`). The
        thread count changes float sums, so a resumed run must see the same cores."""
        mpi = self.backend == MPI_RING
        if self.device_backend.is_gpu and not mpi:
            return torch.get_num_threads()
        cpus = usable_cpus()
        threads = threads_per_rank(
            os.environ, cpus, local_ranks=self.local_world_size, job_budget=mpi
        )
        torch.set_num_threads(threads)
        log.info(
            "intra-op threads %d per rank (OMP_NUM_THREADS=%s, %s usable cores, %s local ranks)",
            threads,
            os.environ.get("OMP_NUM_THREADS", "unset"),
            cpus,
            self.local_world_size,
        )
        return threads


def agree(what: str, error: BaseException | None, *, payload=None, group=None) -> list:
    """Every rank's outcome of a step all ranks take together (`what`): each gives its error
    (None when it succeeded) and a `payload`, and every rank receives all of them (over `group`,
    default the world's, whose timeout bounds the wait). When any rank failed, every rank raises
    the same DistlmError naming the first rank that failed and its error (a file's name is in
    it), so no rank waits on another that has given up; else the payloads, by rank.

    Every rank must call it once for the step, also the one that failed: a rank that raised
    instead would leave the others waiting until the group's timeout."""
    said = None if error is None else f"{type(error).__name__}: {error}"
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, (said, payload), group=group)
    failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if failed:
        rank, said = failed[0]
        more = f" (and ranks {', '.join(str(r) for r, _ in failed[1:])})" if failed[1:] else ""
        raise DistlmError(f"{what}: rank {rank} failed{more}: {said}") from error
    return [p for _, p in outcomes]


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
    A rank started by a launcher is bound to it first (distlm.runtime.lifeline): it dies with it. The
    device backend (distlm.runtime.device) is decided before the group starts: a node with fewer GPUs
    than ranks is refused naming `ranks_key`, a precision its GPU lacks naming `precision_key`.
    """
    bind_to_launcher()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    hw = DeviceBackend.for_rank(
        device,
        local_rank=local_rank,
        local_ranks=local_world,
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
    topo = Topology(rank, world, local_rank, backend, hw, local_world_size=local_world)
    topo.share_threads()
    log.info("process group up: rank %d of %d, backend %s, %s", rank, world, backend, hw.describe())
    try:
        yield topo
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
