"""A long-lived process's Python heap: its start-up objects kept out of the garbage collector's
full collections. (The C heap of a CPU training rank, glibc keeping the memory it frees, is the
device backend's: distlm.runtime.host.keep_freed_memory.)

    from distlm.runtime.heap import freeze_startup_heap
    freeze_startup_heap("serve engine, stage 0")   # once started: imports done, weights loaded

What a process builds to start (torch's and transformers' modules, the model's Python objects, the
tokenizer) lives as long as the process: hundreds of thousands of objects tracked by the garbage
collector. CPython's full (generation 2) collection walks all of them whenever enough new objects
have survived the younger generations, and a serving process makes objects every step
(requests, items, picks, messages): each such collection stalls every request in flight, which
is the p99 latency (benchmarks/LOG.md, "Serving", has the pauses measured before and after).

`gc.freeze()` moves every object alive at that point to a permanent generation that collections
skip; what the process makes afterwards is collected as before (young objects, and full
collections over the objects made since). It is what the serving engines do after their warm-up
(vLLM's `freeze_gc_heap`, SGLang's `freeze_gc`). A collection runs first, so that start-up
garbage is freed rather than frozen.
"""

from __future__ import annotations

import gc
import time

from distlm.core.log import get_logger

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
