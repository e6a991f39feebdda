"""The device backend: what one rank runs on and how, decided once from the config and the
machine. Stages ask it; none of them branches on the device itself.

    backend = DeviceBackend.for_rank(
        "cuda", local_rank=0, local_ranks=1, ranks_key="train.nproc_per_node",
        precision="auto", precision_key="train.precision", compile=True,
    )
    backend.device            # cuda:0 (torch.cuda.set_device done), or cpu
    backend.precision         # "bf16": auto is bf16 (else fp16) on a GPU, fp32 on the CPU
    with backend.autocast():  # that dtype's autocast, or nothing for fp32
        ...
    backend.kernels           # "cpu": distlm's CPU-tuned kernels; "standard": torch's own ops
    backend.compiled(module)  # torch.compile'd when the config asks for it
    backend.to_device(batch)  # pinned and asynchronous where the device has a host link

Which kernels apply is the device's: on the CPU, the kernels tuned for it (the LM head fused with
its loss in cache-sized chunks, GPT-2's GELU in place; they save memory traffic a CPU is bound
by); on CUDA, standard operations that `torch.compile` fuses, SDPA's flash kernels and
maintained libraries. The CPU-tuned ones made the compiled GPU step slower on an H100 and one
of them (a 0-dim CPU constant) crashed CUDA (benchmarks/LOG.md, "GPU"), so they are
chosen here, once, and never applied everywhere. Both sets compute the same functions to float
rounding, and the CPU tests run both (tests/test_device.py).

A rank refuses a config its node cannot run, naming the key: more ranks on the node than it has
GPUs, `cuda` on a node without one, a precision the GPU lacks. The workflow refuses the same
before its first job when it runs the jobs on this machine (`distlm.runtime.machine`); under SLURM the
node that runs Snakemake has no GPU to ask, so the ranks' check is the one that counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.runtime.host import keep_freed_memory
from distlm.runtime.machine import host_share, ranks_problem

log = get_logger(__name__)

Kernels = Literal["cpu", "standard"]
M = TypeVar("M", bound=torch.nn.Module)
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> str:
    """runtime.device -> "cuda" or "cpu" for this machine ("auto": cuda when there is one)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise DistlmError(f"runtime.device: unknown device {device!r} (cpu, cuda or auto)")
    return device


def check_ranks_fit(local_ranks: int, gpus: int, *, ranks_key: str, where: str) -> None:
    """More ranks on a node than it has GPUs is refused, naming the key that asked for them
    (distlm.runtime.machine.ranks_problem, with what this rank's torch sees)."""
    seen = (
        f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, torch "
        f"{torch.__version__}, CUDA build {torch.version.cuda})"
    )
    problem = ranks_problem(local_ranks, gpus, key=ranks_key, where=where, seen=seen)
    if problem:
        raise DistlmError(problem)


def resolve_precision(requested: str, device: torch.device, *, key: str) -> str:
    """fp32 / bf16 / fp16 for this device (auto: bf16, else fp16, on a GPU; fp32 on the CPU);
    an impossible request is an error naming `key`, never a fallback."""
    if requested not in ("auto", *_AUTOCAST):
        raise DistlmError(f"{key}: unknown precision {requested!r} (auto, fp32, bf16, fp16)")
    if device.type == "cpu":
        if requested == "fp16":
            raise DistlmError(f"{key}: fp16 needs a GPU (use fp32 or bf16 on the CPU)")
        return "fp32" if requested == "auto" else requested
    bf16_ok = torch.cuda.is_bf16_supported()
    if requested == "auto":
        return "bf16" if bf16_ok else "fp16"
    if requested == "bf16" and not bf16_ok:
        raise DistlmError(
            f"{key}: bf16 but {torch.cuda.get_device_name(device)} lacks it; use fp16 or fp32"
        )
    return requested


# -- the device questions of code that holds a torch.device rather than a backend (the
# transfer's planes, evaluation's windows, the engine's static steps, a checkpoint's staging):
# every comparison of a device's type is here, so a new device type is added here alone
# (tests/test_device.py's test_no_device_type_is_named_outside_the_machine_modules)


def is_gpu(device: torch.device) -> bool:
    """Whether `device` is a GPU (CUDA's; the one accelerator distlm runs on)."""
    return device.type == "cuda"


def gpu_count() -> int:
    """The GPUs torch sees in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def gpu_uuid(device: torch.device) -> str | None:
    """The physical GPU behind `device`: its UUID, the same in every process that sees it
    whatever its index there (None off the GPU). Two processes on one GPU have the same."""
    if not is_gpu(device):
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current GPU (a thread starts on GPU 0, whatever its process's
    main thread chose: what NCCL and the caching allocator take when given no device); nothing
    on the host."""
    if is_gpu(device):
        torch.cuda.set_device(device)


def host() -> torch.device:
    """The host's memory and cores: where files are read and host buffers live."""
    return torch.device("cpu")


def gpu_index(device: torch.device) -> int:
    """`device`'s GPU index (the current GPU's for a device without one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def group_device(backend: str) -> torch.device:
    """The device a process group's collectives move tensors on: the current GPU for NCCL, the
    host for gloo."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return host()


def backend_problem(backend: str, device: torch.device) -> str | None:
    """Why process-group backend `backend` cannot move tensors on `device` (None: it can): NCCL
    moves GPU tensors, gloo host ones."""
    if backend == "nccl" and not is_gpu(device):
        return f"backend nccl moves CUDA tensors, and these are on {device}"
    if backend == "gloo" and device.type != "cpu":
        return f"backend gloo moves CPU tensors, and these are on {device} (use nccl)"
    return None


def gpu_problem(device: torch.device) -> str | None:
    """Why a GPU-only library (UCCL's P2P engine) cannot take `device`'s tensors (None: it can)."""
    if not torch.cuda.is_available():
        return f"no GPU: torch {torch.__version__} sees no CUDA device"
    if not is_gpu(device):
        return f"the tensors are on {device}, not a CUDA device"
    return None


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a timing boundary); nothing on the CPU."""
    if is_gpu(device):
        torch.cuda.synchronize(device)


def stream_synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream (what a library outside torch reads
    next); nothing on the CPU."""
    if is_gpu(device):
        torch.cuda.current_stream(device).synchronize()


def free_bytes(device: torch.device) -> int:
    """Memory that can still be taken on `device`: the GPU's free memory (the caching
    allocator's reserve, already the process's, counted as taken), the host's MemAvailable."""
    if is_gpu(device):
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def autocast(device: torch.device, dtype: torch.dtype | None):
    """`dtype`'s autocast on `device` (nothing for None: fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class StreamPoint:
    """A point on `device`'s current stream, after the work queued there so far:
    `synchronize()` waits for it (from any thread). On the host, whose work is done when its call
    returns, every point is passed."""

    def __init__(self, device: torch.device) -> None:
        self._event: Any = None
        if is_gpu(device):
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class CopiesDone(StreamPoint):
    """The current GPU's stream after the copies queued so far: a background checkpoint write
    waits for its staged copies with `synchronize`."""

    def __init__(self) -> None:
        super().__init__(torch.device("cuda", torch.cuda.current_device()))


class DeviceClock:
    """The device time of spans of work (a stage's forward passes): on a GPU, CUDA events read
    once the device has passed them, so timing never waits for it; on the CPU, whose work is the
    host's own, each span's wall time. `stop` gives the seconds of the spans finished since the
    last call (on a GPU one may still be running: it is counted at a later call)."""

    def __init__(self, device: torch.device) -> None:
        self._gpu = is_gpu(device)
        self._t0 = 0.0
        self._start: Any = None
        self._open: list[tuple[Any, Any]] = []  # a GPU's spans not yet read: (start, end)

    def start(self) -> None:
        if self._gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if not self._gpu:
            return time.perf_counter() - self._t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((self._start, end))
        done = 0.0
        while self._open and self._open[0][1].query():
            start, end = self._open.pop(0)
            done += start.elapsed_time(end) / 1e3
        return done


class StepGraph:
    """A step (a function of tensors in place, returning a tensor) captured as a CUDA graph on
    `device` (torch.cuda.graph, as vLLM captures its decode batches), after one run outside it
    on a side stream (cuBLAS workspaces, cuDNN plans: what must not be made during a capture).
    That run computes what the first replay does. `replay` gives the step's output, valid until
    the next replay, which writes the same tensor."""

    def __init__(self, device: torch.device, step) -> None:
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(device).wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._out: torch.Tensor = step()

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self._out


def kernels_for(device: torch.device) -> Kernels:
    """The kernel set that pays on `device`: "cpu" (distlm's CPU-tuned kernels) on the CPU,
    "standard" (torch's own operations, compiled where asked) elsewhere."""
    return "cpu" if device.type == "cpu" else "standard"


@dataclass(frozen=True)
class DeviceBackend:
    """One rank's device, precision, compile policy and kernel set (see the module doc)."""

    device: torch.device
    precision: str = "fp32"  # fp32 | bf16 | fp16, resolved for the device
    compile: bool = False  # torch.compile the modules the stage hands to `compiled`
    # the kernel set: the device's (see `kernels_for`); given only by tests, which run the GPU's
    # set on the CPU to check its numerics there
    kernels: Kernels = None  # pyright: ignore[reportAssignmentType]
    # Whether rank 0 writes checkpoints in a background thread after copying them to host memory
    # (distlm.train.checkpoint): on a GPU, where the copy is fast and the write slow; on the CPU
    # the copy costs what the write saves, so it writes in the loop. Given only by tests.
    background_checkpoints: bool = None  # pyright: ignore[reportAssignmentType]
    # Whether the pipeline engine's decode steps run as static steps, one per block of cache
    # rows, captured as CUDA graphs (distlm.inference.engine.graphs' `DecodeGraphs`): on
    # a GPU, where a decode step is bound by launching its kernels; on the CPU each kernel's own
    # time dominates and the eager step, sized to its items, does less. Given only by tests,
    # which run the static steps on the CPU (without a capture) to check their numerics.
    decode_graphs: bool = None  # pyright: ignore[reportAssignmentType]
    # Whether those static steps are captured and replayed as CUDA graphs: on a GPU. Given only
    # by tests, which ask for a capture on the CPU to check what a failed one does.
    capture_graphs: bool = None  # pyright: ignore[reportAssignmentType]
    # How many micro-batches a one-stage engine keeps on the device at once
    # (distlm.inference.engine.scheduler; inference.steps_in_flight): 2 has the host finish one
    # (its picks, its messages) and prepare the next while the device runs the other; 1, the
    # default on every device until a GPU's figures say otherwise (the CPU's: docs/performance.md).
    steps_in_flight: int = 1

    def __post_init__(self) -> None:
        if self.kernels is None:
            object.__setattr__(self, "kernels", kernels_for(self.device))
        if self.background_checkpoints is None:
            object.__setattr__(self, "background_checkpoints", is_gpu(self.device))
        if self.decode_graphs is None:
            object.__setattr__(self, "decode_graphs", is_gpu(self.device))
        if self.capture_graphs is None:
            object.__setattr__(self, "capture_graphs", is_gpu(self.device))

    @classmethod
    def for_rank(
        cls,
        device: str,
        *,
        local_rank: int = 0,
        local_ranks: int = 1,
        ranks_key: str = "the stage's rank count",
        precision: str = "fp32",
        precision_key: str = "precision",
        compile: bool = False,
        share_gpus: bool = False,
        graphs: bool = True,
        steps_in_flight: int = 1,
    ) -> DeviceBackend:
        """This rank's backend: local rank `local_rank` of the `local_ranks` on its node, each
        on a GPU of its own when the device is cuda (made the current device here).

        `share_gpus`: ranks that talk through host memory, not NCCL (the MPI pipeline's stages,
        each holding a slice of the model), take the node's GPUs in turn when there are more
        ranks than GPUs; NCCL ranks (torch.distributed stages) need one GPU each. `graphs`: false
        keeps a GPU's decode steps eager (inference.cuda_graphs); `steps_in_flight`: the one-stage
        engine's micro-batches on the device at once (inference.steps_in_flight)."""
        kind = resolve_device(device)
        if kind == "cpu":
            dev = torch.device("cpu")
        else:
            gpus = gpu_count()
            ranks = max(local_ranks, local_rank + 1)
            check_ranks_fit(
                min(ranks, gpus) if share_gpus else ranks,
                gpus,
                ranks_key=ranks_key,
                where=_node(),
            )
            dev = torch.device("cuda", local_rank % gpus)
            torch.cuda.set_device(dev)
        hw = cls(dev, resolve_precision(precision, dev, key=precision_key), compile)
        if steps_in_flight != hw.steps_in_flight:
            hw = dataclasses.replace(hw, steps_in_flight=steps_in_flight)
        return hw if graphs else dataclasses.replace(hw, decode_graphs=False, capture_graphs=False)

    @classmethod
    def cpu(cls) -> DeviceBackend:
        return cls(torch.device("cpu"))

    # -- what the device decides -----------------------------------------------------------
    @property
    def is_gpu(self) -> bool:
        return is_gpu(self.device)

    @property
    def cpu_kernels(self) -> bool:
        """Whether this rank runs distlm's CPU-tuned kernels (`kernels_for`)."""
        return self.kernels == "cpu"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST[self.precision]

    def autocast(self):
        """The precision's autocast context (nothing for fp32)."""
        return autocast(self.device, self.autocast_dtype)

    def keep_compile_cache(self, folder: Path) -> None:
        """Have torch.compile (inductor, Triton) keep its caches in `folder`, the stage's, not in
        /tmp (a node's, gone with the job): a resumed or requeued run, or the next one, loads its
        compiled graphs instead of compiling again. A cache the user set stays theirs; inductor's
        defaults are not one: inductor writes its folder into the environment once it has looked,
        and Triton's under it (`<folder>/triton/<device>`) once it has built a kernel, and a
        process started from one that compiled inherits them."""
        if not self.compile:
            return
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = Path(os.path.abspath(default_cache_dir()))
        for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            value = os.environ.get(var)
            if value is None or Path(os.path.abspath(value)).is_relative_to(default):
                os.environ[var] = str(folder / sub)
        log.info("torch.compile's caches: %s", os.environ["TORCHINDUCTOR_CACHE_DIR"])

    def compile_cache_use(self) -> str:
        """What torch.compile's caches gave this process so far, for the log: its compiled graphs
        loaded from the cache (`keep_compile_cache`'s folder) and compiled afresh, as inductor
        counts them: a graph the cache cannot hold (a bypass) is compiled too ("" without
        compile)."""
        if not self.compile:
            return ""
        from torch._dynamo.utils import counters

        hits, misses, bypassed = (
            counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")
        )
        return f"{hits} graph(s) from the compile cache, {misses + bypassed} compiled"

    def compiled(self, module: M) -> M:
        """`module` under torch.compile when the config asks for it (the same module otherwise).
        An nn.Module compiles to an OptimizedModule that calls like it (the stub says Callable)."""
        return torch.compile(module) if self.compile else module  # pyright: ignore[reportReturnType]

    # -- moving data and state ---------------------------------------------------------------
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on this device: through pinned memory, without waiting, on a GPU."""
        if self.pin_host:
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    @property
    def ddp_device_ids(self) -> list[int] | None:
        return [self.device.index] if self.is_gpu else None

    def synchronize(self) -> None:
        """Wait for the device's queued work (a timing boundary); nothing on the CPU."""
        synchronize(self.device)

    def rng_state(self) -> dict[str, Any]:
        """The RNG states a resumed rank needs (torch's CPU one, Python's, the GPU's), as
        weights_only-safe data."""
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": [version, list(internal), gauss],
        }
        if self.is_gpu:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if self.is_gpu:
            if "cuda" not in state:
                raise DistlmError("checkpoint holds no CUDA RNG state (it was made on the CPU)")
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def keep_host_memory(self, what: str) -> bool:
        """A training rank's C heap: on the CPU, glibc keeps what the rank frees for its next
        step's tensors (`keep_freed_memory`, a CPU-tuned setting); a GPU rank's host memory is
        left as it is. True when the setting was made."""
        return keep_freed_memory(what) if self.cpu_kernels else False

    def peak_memory(self) -> int:
        """The most memory this rank has held so far: its GPU's allocations (torch's count), or
        on the CPU the process's peak resident size."""
        if self.is_gpu:
            return torch.cuda.max_memory_allocated(self.device)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def memory(self, local_ranks: int) -> tuple[int, str]:
        """(bytes this rank has for itself, what they are, for an error): its GPU's, or on the
        CPU its share of the host's memory among the `local_ranks` ranks on it
        (distlm.runtime.dist.Topology.local_world_size)."""
        if self.is_gpu:
            return torch.cuda.get_device_properties(self.device).total_memory, (
                f"its GPU ({gpu_name(self.device)})"
            )
        ranks = max(1, local_ranks)
        return host_share(ranks), f"its share of the host's memory ({ranks} ranks)"

    @property
    def pin_host(self) -> bool:
        """Whether host buffers bound for the device are pinned (page-locked: copied without a
        staging copy, asynchronously): on a GPU."""
        return self.is_gpu

    def describe(self) -> str:
        what = str(self.device)
        if self.is_gpu:
            what += f" ({gpu_name(self.device)})"
        return (
            f"{what}, precision {self.precision}, kernels {self.kernels}, "
            f"compile {'on' if self.compile else 'off'}"
        )


def _node() -> str:
    return f"this node ({socket.gethostname()})"
