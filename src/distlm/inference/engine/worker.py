"""Stages 1..S-1: forward what arrives from the previous stage, pass it on; until Stop.

The last stage picks each sequence's next token (sampler.last_stage) and sends the picks back to
stage 0 as Tokens. Lanes stage 0 freed arrive with a Work message (Work.release) and are freed
here before its micro-batch runs. A live update's Prepare starts this stage's staging (in a thread,
engine/update.py) and goes on at once; the staging's word rides the next Work or Tokens past this
stage; Swap switches to the staged weights, or drops them, and goes on.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from distlm.inference.engine.pipeline_stage import StageModel
from distlm.inference.engine.ring import (
    Hello,
    Pick,
    PipelineError,
    Prepare,
    Ring,
    Stop,
    Swap,
    Tokens,
    Work,
    from_wire,
    stage_info,
    to_wire,
)
from distlm.inference.engine.sampler import Sampler, fork_caches, last_stage, release_lanes
from distlm.inference.engine.update import NewWeights
from distlm.inference.stats import StageStats


def worker_loop(model: StageModel, ring: Ring, stats: StageStats) -> None:
    """A later stage: forward what arrives, pass it on (or the picked tokens back); until stop."""
    sampler = Sampler()
    last = ring.topo.is_last
    staging: NewWeights | None = None
    while True:
        msg = ring.recv()
        if isinstance(msg, Prepare):
            staging = NewWeights(model, msg)
            ring.send(msg)
        elif isinstance(msg, Swap):
            if staging is None:
                raise PipelineError(f"stage {ring.topo.rank}: Swap of an update it never staged")
            staging.finish(msg)
            staging = None
            ring.send(msg)
        elif isinstance(msg, Hello):
            ring.send(Hello((*msg.infos, stage_info(model))))
            stats.reset()  # count the steady state, not the wait for the others to load
        elif isinstance(msg, Stop):
            ring.send(Stop((*msg.stats, replace(stats))))
            return
        elif isinstance(msg, Work):
            release_lanes(model, sampler if last else None, msg.release)
            picks: list[Pick] = []
            hidden: torch.Tensor | None = None
            if msg.slots:
                if msg.payload is None:
                    raise PipelineError(f"stage {ring.topo.rank}: a micro-batch without its input")
                items = [sl.item for sl in msg.slots]
                t0 = time.perf_counter()
                x = from_wire(msg.payload)
                model.clock.start()
                if last:
                    picks = last_stage(model, sampler, msg.slots, x)
                else:
                    hidden = model(items, x)
                fork_caches(model, msg.slots)
                stats.device_s += model.clock.stop()
                stats.compute_s += time.perf_counter() - t0
                stats.micro_batches += 1
                stats.items += len(items)
            stats.cache_bytes = model.cached_bytes()
            seen = (*msg.stats, stats.brief())
            word = staging.take_word() if staging is not None else None
            staged = msg.staged if word is None else (*msg.staged, word)
            if last:
                ring.send(Tokens(tuple(picks), seen, staged))
            else:
                wire = to_wire(hidden) if hidden is not None else None
                ring.send(
                    Work(msg.slots, wire, seen, msg.release, staged), wire[1].nbytes if wire else 0
                )
        else:
            raise PipelineError(f"stage {ring.topo.rank}: unexpected {type(msg).__name__}")
