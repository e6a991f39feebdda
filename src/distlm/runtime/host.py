"""The host a rank runs on: its share of the cores (`threads_per_rank`, from the launcher's
OMP_NUM_THREADS and the cores this process may use) and its C heap (`keep_freed_memory`: glibc
keeps what a training rank frees for its next step). The device backend (distlm.runtime.device)
and the ranks' topology (distlm.runtime.dist) ask these; no stage does."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

from distlm.core.log import get_logger

log = get_logger(__name__)


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a SLURM step's or taskset's share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(
    env: Mapping[str, str],
    cpus: int,
    *,
    local_ranks: int | None = None,
    job_budget: bool = False,
) -> int:
    """Intra-op threads for one of the `local_ranks` ranks on a host (default: env's
    LOCAL_WORLD_SIZE) whose process may use `cpus` cores; at least one.

    OMP_NUM_THREADS is per process in torchrun's meaning (it sets 1 when it starts several
    ranks), but Snakemake sets it to the rule's `threads`, the job's total, which torchrun passes
    on to every rank: so it is only a ceiling on the rank's share of the cores. With `job_budget`
    (mpiexec, which sets none of its own) it is the job's budget, the cores when unset, shared
    equally by the ranks."""
    local = local_ranks or int(env.get("LOCAL_WORLD_SIZE") or 1)
    omp = env.get("OMP_NUM_THREADS")
    if job_budget:
        return max(1, (int(omp) if omp else cpus) // local)
    share = max(1, cpus // local)
    return min(int(omp), share) if omp else share


# mallopt(3)'s parameters, and what keep_freed_memory sets them to
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_KEEP = (
    ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, 1 << 30),  # blocks below 1 GiB from the heap
    ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, (1 << 31) - 1),  # its free top kept (mallopt: an int)
    ("M_TOP_PAD", _M_TOP_PAD, 64 << 20),  # and grown 64 MiB at a time
)


def keep_freed_memory(what: str) -> bool:
    """Have glibc's malloc keep the memory this process frees for its next allocations instead
    of handing it back to the kernel; True when glibc took every setting.

    A training step frees and makes again tensors of the same sizes (activations, gradients, the
    LM head's chunks of logits). By default glibc serves blocks from 128 KiB up (a threshold it
    raises to the largest block freed, up to 32 MiB) with their own mmap, unmapped when freed,
    and trims the heap's free top above twice that threshold: the next step's tensors fault their
    pages in again, and the kernel zeroes each page. On the embedded default that was up to
    ~2,600 page faults a rank a step (10 MiB; how many varies from run to run), ~1.7 us each;
    with this, almost none, and the step's median ~3% shorter (benchmarks/LOG.md,
    "Training"). It is what the environment variables MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_ and MALLOC_TOP_PAD_ set before a process starts, and what PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`) gets from
    jemalloc with its decay turned off. The process then holds its peak heap until it exits,
    which a training rank reaches every step anyway; so training ranks call it, serving
    processes (whose tensors a step are small, and whose load comes and goes) do not."""
    libc, version = platform.libc_ver()
    if platform.system() != "Linux" or libc != "glibc":
        log.info(
            "%s: the C library is not glibc (%s): freed memory goes back as it decides",
            what,
            f"{platform.system()}, {libc or 'unknown'}",
        )
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [name for name, param, value in _KEEP if mallopt(param, value) != 1]
    if refused:
        log.warning(
            "%s: glibc %s refused mallopt %s: freed memory may go back to the kernel and be "
            "faulted in again",
            what,
            version,
            ", ".join(refused),
        )
        return False
    log.info(
        "%s: glibc %s keeps freed memory for reuse (%s)",
        what,
        version,
        ", ".join(f"{name} {value >> 20} MiB" for name, _, value in _KEEP),
    )
    return True
