"""What the machine has, read without torch: the GPUs CUDA would see on this node.

The workflow reads this while it builds the DAG (no torch there: `distlm.settings`' contract), to
refuse before the first job a config that asks for more GPUs than this machine has, with the
key to change. Under SLURM the node that runs Snakemake usually has no GPU; there the check is
the ranks' own (`distlm.runtime.device`), where they run.

    visible_gpus()   # 0 on a machine without the NVIDIA driver; CUDA_VISIBLE_DEVICES honoured
    this_machine()   # Machine(gpus, gpu_memory, host_memory): what a config's ranks would get
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")  # one folder per GPU, written by the driver


def physical_gpus() -> int:
    """The NVIDIA GPUs the driver shows on this node (0 without the driver)."""
    if NVIDIA_PROC.is_dir():
        return sum(1 for _ in NVIDIA_PROC.iterdir())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def visible_count(physical: int, env: Mapping[str, str]) -> int:
    """The GPUs CUDA shows a process with `env`: CUDA_VISIBLE_DEVICES' entries up to the first
    invalid one (CUDA's rule), at most the physical count; all of them when it is unset."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return physical
    n = 0
    for item in (s.strip() for s in spec.split(",")):
        if not item or item.startswith("-"):
            break  # an empty or negative entry hides it and every later one
        n += 1
    return min(n, physical)


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
    """The GPUs a process started here with `env` (default: this one's) would see."""
    return visible_count(physical_gpus(), os.environ if env is None else env)


def gpu_memory() -> int | None:
    """Bytes of memory of this node's smallest GPU (nvidia-smi's), None without the driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    q = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(q, capture_output=True, text=True, timeout=20, check=False).stdout
        mib = [int(line.strip()) for line in out.splitlines() if line.strip().isdigit()]
    except (OSError, subprocess.TimeoutExpired):
        return None
    return min(mib) << 20 if mib else None


# What `runtime.device`'s values (distlm.settings' DeviceSettings) ask of the machine, for the
# settings' checks (no torch there); distlm.runtime.device resolves them for a rank, with torch.
def may_use_gpu(device: str) -> bool:
    """Whether ranks of `runtime.device` `device` may run on GPUs (cuda, or auto on a GPU node)."""
    return device != "cpu"


def needs_gpu(device: str) -> bool:
    """Whether `runtime.device` `device` refuses a node without a GPU (cuda)."""
    return device == "cuda"


def ranks_problem(
    ranks: int | None,
    gpus: int,
    *,
    key: str,
    where: str,
    stage: str = "",
    seen: str = "",
    fix: str = "",
) -> str | None:
    """Why `ranks` ranks on one node, a GPU each (None: one rank per GPU, torchrun's
    --nproc-per-node=gpu), cannot run on `where`, which has `gpus` GPUs that CUDA can see; None
    when they can. The one rule of "the ranks fit the GPUs", asked where each launch path sees the
    GPUs: the workflow before any job (distlm.settings.ranks), the SLURM launcher on each node
    (distlm.launch.srun) and every rank (distlm.runtime.device). The problem names `key`, the count that
    asked for the ranks, and `stage` when the count is not the key's value (the broadcast's
    ranks are its receivers and the sender); `seen` says what was looked at, `fix` adds a way out
    of a node without a GPU."""
    if gpus == 0:
        if ranks is None:
            return (
                f"{key}: null means one rank per GPU, and {where} has none that CUDA can see"
                f"{seen}; set {key}, or runtime.device: cpu{fix}"
            )
        return (
            f"runtime.device: cuda, but {where} has no GPU that CUDA can see{seen}; set "
            f"runtime.device: cpu (or auto), or run on a GPU machine{fix}"
        )
    if ranks is not None and ranks > gpus:
        return (
            f"{key}: {ranks} ranks{f' of stage {stage}' if stage else ''} on {where}, which has "
            f"{gpus} GPU(s) (one rank a GPU); set "
            f"{key} to fit, or null for one rank per GPU"
        )
    return None


def host_memory() -> int:
    """Bytes of this node's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_share(ranks: int, host: int | None = None) -> int:
    """Bytes of the host's memory (`host`, default this node's) that each of `ranks` CPU ranks on
    it has for itself."""
    return (host_memory() if host is None else host) // max(1, ranks)


@dataclass(frozen=True)
class Machine:
    """What a rank started here would get: GPUs CUDA sees, each GPU's memory (None when unknown),
    and the host's memory (the CPU ranks share it)."""

    gpus: int
    gpu_memory: int | None
    host_memory: int


def this_machine(env: Mapping[str, str] | None = None) -> Machine:
    gpus = visible_gpus(env)
    return Machine(gpus, gpu_memory() if gpus else None, host_memory())
