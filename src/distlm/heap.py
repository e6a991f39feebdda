"""A long-lived process's heap: its start-up objects kept out of the garbage collector's full
collections, and the memory it frees kept for its next allocations.

    from distlm.heap import freeze_startup_heap, keep_freed_memory
    freeze_startup_heap("serve engine, stage 0")   # once started: imports done, weights loaded
    keep_freed_memory("rank 0")                    # a training rank, before its first step

What a process builds to start (torch's and transformers' modules, the model's Python objects, the
tokenizer) lives as long as the process: hundreds of thousands of objects tracked by the garbage
collector. CPython's full (generation 2) collection walks all of them whenever enough new objects
have survived the younger generations, and a serving process makes objects every step
(requests, items, picks, messages): each such collection stalls every request in flight, which
is the p99 latency (docs/performance.md, "Serving", has the pauses measured before and after).

`gc.freeze()` moves every object alive at that point to a permanent generation that collections
skip; what the process makes afterwards is collected as before (young objects, and full
collections over the objects made since). It is what the serving engines do after their warm-up
(vLLM's `freeze_gc_heap`, SGLang's `freeze_gc`). A collection runs first, so that start-up
garbage is freed rather than frozen.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import time

from distlm.log import get_logger

log = get_logger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now out of later collections; the count frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        what,
        frozen,
        (time.perf_counter() - t0) * 1e3,
    )
    return frozen


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
    with this, almost none, and the step's median ~3% shorter (docs/performance.md,
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
