"""Stage 0's scheduler: the lane policy, micro-batches, and the one loop that drives them.

Stage 0 admits sequences into *lanes* (one KV cache per lane on every stage), packs ready lanes
into micro-batches of at most ceil(lanes / stages) and keeps up to `stages` micro-batches in
flight, so different prompts occupy different stages at the same moment. The last stage sends each
sequence's next token back; the scheduler decides whether it goes round again or finishes. A
finished (or cancelled) sequence's lane is freed at once on stage 0 and, with the next message
round the ring, on every other stage (Work.release), so an idle pipeline holds no KV cache.

A one-stage pipeline keeps `steps_in_flight` micro-batches on its device at once (`local`; the
device backend's, inference.steps_in_flight: 1 by default). With 2, each takes an even share of
the running sequences: stage 0 queues one step's forward pass and the reads its picks need
(sampler.LastStep), then waits for the step before it and picks its tokens, which the engine
sends while the device runs the new one, so the host's work on a step's outputs and on the next
step's inputs overlaps the device's. A sequence is in one micro-batch at a time, and one
cancelled while its step is on the device ends when that step's token comes back, as in a
pipeline of several stages. With 1 each step is picked as it returns. (On the CPU, whose forward
pass is the host's own work, 2 only halves the micro-batches; what it gives either device:
docs/performance.md.)

Where the stages replay their decode steps as CUDA graphs (`StageModel.graphs`: a GPU's), a
micro-batch is either decodes or prefills, never both: a mixed one runs eagerly, a few hundred
kernel launches, where a decode step alone is one graph. Prefills then wait for one another up
to PREFILL_EVERY decode micro-batches and go together (`_pick`), as vLLM's decode-first
scheduling batches its prefills; elsewhere (the CPU, whose eager step is sized to its items) a
micro-batch takes decodes and prefills as they come.

`run_stage0` is stage 0's only loop, for the batch stage and the serve engine alike: they differ
in the hooks they pass (where requests come from, what happens when the pipeline is idle).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from distlm.inference.engine.pipeline_stage import Item, StageModel
from distlm.inference.engine.ring import (
    Backoff,
    Fork,
    Hello,
    Pick,
    PipelineError,
    Prepare,
    Prepared,
    Ring,
    Slot,
    Stop,
    Swap,
    Tokens,
    Work,
    stage_info,
    to_wire,
)
from distlm.inference.engine.sampler import LastStep, Sampler, fork_caches, launch_last_stage
from distlm.inference.sampling_params import SamplingParams
from distlm.inference.stats import StageBrief, StageInfo, StageStats
from distlm.runtime.dist import Topology

# With decode graphs: how many decode micro-batches a ready prefill may wait for before it goes
# (with every other prefill ready then). A mixed micro-batch is eager (a few hundred kernel
# launches), a decode one a graph (one launch; their costs: docs/performance.md): prefills
# gathered over 4 decode steps cost one eager step in 5 instead of every step, for up to 4 decode
# steps of waiting.
PREFILL_EVERY = 4


@dataclass
class Sequence:
    """One prompt's generation; callbacks run on stage 0's main thread.

    `siblings`: the other choices of an n > 1 request, same prompt; they fork this sequence's
    prefill when lanes are free at its admission, else they queue as sequences of their own.
    """

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_token: Callable[[Sequence, Pick], None] | None = None
    on_done: Callable[[Sequence], None] | None = None
    on_prompt: Callable[[Sequence, Pick], None] | None = None  # the prompt's log-probabilities
    lane: int = -1
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, cancelled, error
    error: str | None = None
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # its finish reason once cancelled ("abort": an update's)
    siblings: list[Sequence] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    def timing(self) -> dict:
        gen_s = self.t_done - self.t_first
        return {
            "ttft_s": self.t_first - self.t_submit,
            "queue_s": self.t_admit - self.t_submit,
            "total_s": self.t_done - self.t_submit,
            "tokens": len(self.tokens),
            # decode rate after the first token; a single token has none
            "decode_tokens_per_s": (len(self.tokens) - 1) / gen_s
            if len(self.tokens) > 1 and gen_s > 0
            else None,
            "tokens_per_s": len(self.tokens) / (self.t_done - self.t_submit),
        }


def _slots(items: list[Item], seqs: list[Sequence]) -> tuple[Slot, ...]:
    # Sampling parameters travel with a sequence's prefill, once; the last stage keeps them per lane.
    return tuple(
        Slot(
            it,
            s.params,
            tuple(Fork(f.id, f.lane, f.params) for f in s.forks),
            tuple(s.prompt_ids) if s.params.prompt_logprobs is not None else None,
        )
        if it.pos == 0
        else Slot(it)
        for it, s in zip(items, seqs)
    )


class Scheduler:
    """Stage 0: lanes, micro-batches, and the decision to continue or finish each sequence."""

    def __init__(
        self,
        model: StageModel,
        ring: Ring | None,
        topo: Topology,
        *,
        lanes: int,
        eos_token_id: int | None,
        context: int,
        timeout_s: float,
        stats: StageStats,
    ) -> None:
        self.model, self.ring, self.topo = model, ring, topo
        self.lanes = lanes
        # micro-batches in flight at once: one a stage round a pipeline's ring; on one stage the
        # device backend's `steps_in_flight` (see `_launch`)
        self.max_in_flight = (
            topo.world_size if ring is not None else topo.device_backend.steps_in_flight
        )
        self.cap = math.ceil(lanes / self.max_in_flight)  # sequences per micro-batch
        self.eos = eos_token_id
        self.context = context
        self.timeout_s = timeout_s
        self.stats = stats
        self.sampler = Sampler()
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.active: dict[int, Sequence] = {}
        self.free = list(range(lanes - 1, -1, -1))
        self.in_flight = 0  # micro-batches launched and not yet back (at most max_in_flight)
        # a one-stage pipeline's micro-batches on the device, oldest first (see `_launch`)
        self.local: deque[LastStep] = deque()
        self.launching = True  # False: only collect what is in the ring (shutting down)
        self.progress_at = time.monotonic()
        self.last_send = time.monotonic()
        self._next_id = 0
        self.stage_stats: dict[int, StageBrief] = {}  # later stages' briefs, as last seen
        self.released: list[int] = []  # lanes freed here, to free on the other stages too
        # decodes and prefills in micro-batches of their own: where decode steps are graphs
        self.separate = model.graphs is not None
        self.prefill_wait = 0  # decode micro-batches launched while a prefill was ready
        # a live update (engine/update.py): while set, a waiting sequence for which it is true
        # does not start; what comes back round the ring of an update's messages goes to `on_ring`
        self.hold: Callable[[Sequence], bool] | None = None
        self.on_ring: Callable[[Prepare | Swap], None] | None = None
        self.words: list[Prepared] = []  # stages' words on an update's staging, as they came

    # -- public

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def submit(self, seq: Sequence) -> None:
        seq.t_submit = seq.t_submit or time.perf_counter()
        for sib in seq.siblings:
            sib.t_submit = seq.t_submit
        self.waiting.append(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence: at once when it is not in the ring, else when its token comes back;
        it finishes with `reason`."""
        if seq.finish_reason is not None:
            return
        seq.cancelled, seq.cancel_reason = True, reason
        for queue in (self.waiting, self.ready):
            if seq in queue:
                queue.remove(seq)
                if queue is self.waiting:  # its siblings have not found lanes: they queue now
                    self.waiting.extendleft(reversed(seq.siblings))
                    seq.siblings = []
                self._finish(seq, reason)
                return

    @property
    def lanes_busy(self) -> int:
        return self.lanes - len(self.free)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.ready or self.in_flight)

    def step(self) -> bool:
        """Do what can be done now without waiting; False when nothing could (caller pauses)."""
        did = False
        while self.ring is not None and self.in_flight and self.ring.ready():
            self._reply(self.ring.take())
            did = True
        held: list[Sequence] = []
        while self.launching and self.waiting and self.free:
            seq = self.waiting.popleft()
            if seq.cancelled:
                self._finish(seq, seq.cancel_reason)
                continue
            if self.hold is not None and self.hold(seq):
                held.append(seq)
                continue
            self._admit(seq)
            self.ready.append(seq)
            # n > 1: the siblings that find a lane now share this prefill; the rest queue first
            left = []
            for sib in seq.siblings:
                if self.free and not sib.cancelled:
                    self._admit(sib)
                    seq.forks.append(sib)
                else:
                    left.append(sib)
            self.waiting.extendleft(reversed(left))
            seq.siblings = []
        self.waiting.extendleft(reversed(held))
        if self.launching and self.ready and self.in_flight < self.max_in_flight:
            batch = self._pick()
            batch.sort(key=_launch_order)
            self._launch(batch)
            return True
        if self.local:  # nothing to launch first: now wait for the device's oldest step
            self._land()
            return True
        if self.in_flight and not did and time.monotonic() - self.progress_at > self.timeout_s:
            raise PipelineError(
                f"stage 0: no tokens back from the pipeline (stages 1-{self.topo.world_size - 1}) for "
                f"{self.timeout_s:g} s (inference.timeout_s): a stage died or hangs"
            )
        return did

    def heartbeat(self, every_s: float) -> None:
        """When idle, send an empty micro-batch round the ring, so every stage knows the others
        live; at once when lanes were freed since the last message (the others free them too)."""
        if self.ring is None or self.busy:
            return
        if self.released or time.monotonic() - self.last_send > every_s:
            self._send_work((), None)

    def ping(self) -> None:
        """An empty micro-batch round the ring now, when none is in flight: it carries the
        stages' words on an update's staging back (an idle ring has nothing else to carry them)."""
        if self.ring is not None and not self.in_flight:
            self._send_work((), None)

    def send_ring(self, msg: Prepare | Swap) -> None:
        """An update's message round the ring (it comes back to `on_ring`)."""
        if self.ring is None:
            raise PipelineError("stage 0: a one-stage pipeline sends nothing")
        if self.in_flight == 0:
            self.progress_at = time.monotonic()
        self.ring.send(msg)
        self.in_flight += 1

    def hello(self) -> list[StageInfo]:
        """Each stage adds where it runs (host, pid, layers); stage 0 gets the list back."""
        infos = (stage_info(self.model),)
        if self.ring is None:
            return list(infos)
        self.ring.send(Hello(infos))
        msg = self.ring.recv()
        if not isinstance(msg, Hello):
            raise PipelineError(f"stage 0: expected Hello back, got {type(msg).__name__}")
        return list(msg.infos)

    def stop(self) -> list[dict]:
        """End the workers; each adds its StageStats on the way round (as dicts, for timing.json)."""
        ring = self.ring
        if ring is None:
            return [self.stats.to_dict()]
        ring.send(Stop((replace(self.stats),)))
        msg = ring.recv()
        while isinstance(msg, (Tokens, Prepare, Swap)):  # a heartbeat or an update on its way
            msg = ring.recv()
        if not isinstance(msg, Stop):
            raise PipelineError(f"stage 0: expected Stop back, got {type(msg).__name__}")
        return [s.to_dict() for s in msg.stats]

    def drain(self, timeout_s: float) -> None:
        """Stop launching; wait (at most timeout_s) for the micro-batches in the ring to come home."""
        self.launching = False
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while self.in_flight:
            if not self.step():
                if time.monotonic() > deadline:
                    raise PipelineError("stage 0: the ring did not drain while stopping")
                backoff.pause()

    def fail_all(self, reason: str) -> list[Sequence]:
        """The pipeline is gone: every sequence not yet finished ends with `reason` (finish
        reason error, its callbacks not called: the caller reports the failure once, for all)
        and every lane and its KV cache on this stage is freed; the sequences, to report."""
        seqs = list(self.waiting) + list(self.active.values())
        seqs += [sib for s in self.waiting for sib in s.siblings]
        now = time.perf_counter()
        for seq in seqs:
            seq.finish_reason, seq.error, seq.t_done = "error", reason, now
        for lane in range(self.lanes):
            self.model.release(lane)
            self.sampler.release(lane)
        self.stats.cache_bytes = self.model.cached_bytes()
        self.waiting.clear()
        self.ready.clear()
        self.active.clear()
        self.free = list(range(self.lanes - 1, -1, -1))
        self.released.clear()
        self.local.clear()
        self.in_flight = 0
        return seqs

    # -- internals

    def _pick(self) -> list[Sequence]:
        """The next micro-batch: up to `cap` ready sequences (on one stage with steps in flight,
        up to an even share of the running ones, so that 16 sequences go in two steps of 8, not
        one of 16 with nothing beside it), oldest first; where decode steps are graphs
        (`separate`), decodes alone, or the ready prefills alone once they have waited
        PREFILL_EVERY decode micro-batches (or when there is no decode to run)."""
        cap = self.cap
        if self.ring is None and self.max_in_flight > 1:  # an even share of the running sequences:
            cap = min(cap, math.ceil(len(self.active) / self.max_in_flight))  # a step beside each
        if not self.separate:
            return [self.ready.popleft() for _ in range(min(cap, len(self.ready)))]
        prefills = [s for s in self.ready if not s.tokens]
        decodes = [s for s in self.ready if s.tokens] if prefills else list(self.ready)
        if prefills and (not decodes or self.prefill_wait >= PREFILL_EVERY):
            batch, self.prefill_wait = prefills[:cap], 0
        else:
            batch = decodes[:cap]
            self.prefill_wait += bool(prefills)
        chosen = {id(s) for s in batch}
        self.ready = deque(s for s in self.ready if id(s) not in chosen)
        return batch

    def _release(self, lane: int) -> None:
        """The lane's sequence ended: its KV cache is freed here now, on the others with the
        next message (a lane is reused only by a later prefill, which follows that message)."""
        self.free.append(lane)
        self.model.release(lane)
        self.stats.cache_bytes = self.model.cached_bytes()
        if self.ring is None:  # this rank is also the last stage
            self.sampler.release(lane)
        else:
            self.released.append(lane)

    def _admit(self, seq: Sequence) -> None:
        seq.lane = self.free.pop()
        seq.t_admit = time.perf_counter()
        self.active[seq.id] = seq

    def _launch(self, batch: list[Sequence]) -> None:
        items, ids = [], []
        for s in batch:
            if not s.tokens:
                items.append(Item(s.id, s.lane, 0, len(s.prompt_ids)))
                ids.extend(s.prompt_ids)
            else:
                items.append(Item(s.id, s.lane, len(s.prompt_ids) + len(s.tokens) - 1, 1))
                ids.append(s.tokens[-1])
        t0 = time.perf_counter()
        slots = _slots(items, batch)
        x = torch.tensor(ids, dtype=torch.long)
        hidden: torch.Tensor | None = None
        self.model.clock.start()
        if self.ring is None:  # a one-stage pipeline: this rank is also the last stage
            self.local.append(
                launch_last_stage(self.model, self.sampler, slots, x, hold=self.max_in_flight > 1)
            )
            self.in_flight += 1
        else:
            hidden = self.model(items, x)
        fork_caches(self.model, slots)
        self.stats.device_s += self.model.clock.stop()
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.micro_batches += 1
        self.stats.items += len(items)
        self.stats.cache_bytes = self.model.cached_bytes()
        for s in batch:
            s.forks = []
        if self.ring is not None:
            self._send_work(slots, hidden)
            return
        # One stage: with `max_in_flight` 2 the step just queued runs on the device while the host
        # waits for the one before it, then picks its tokens and sends them (the engine's
        # after_step) and prepares the next; with 1 it is picked at once. A sequence is in one
        # micro-batch at a time, so each step's positions and inputs are its tokens so far.
        while len(self.local) >= self.max_in_flight:
            self._land()

    def _land(self) -> None:
        """The oldest of a one-stage pipeline's micro-batches on the device: its picks."""
        t0 = time.perf_counter()
        picks = self.local.popleft().picks()
        self.stats.compute_s += time.perf_counter() - t0
        self.in_flight -= 1
        self.progress_at = time.monotonic()
        self._picks(picks)

    def _send_work(self, slots: tuple[Slot, ...], out: torch.Tensor | None) -> None:
        if self.ring is None:
            raise PipelineError("stage 0: a one-stage pipeline sends nothing")
        payload = to_wire(out) if out is not None else None
        if self.in_flight == 0:
            self.progress_at = time.monotonic()
        release, self.released = tuple(self.released), []
        self.ring.send(Work(slots, payload, release=release), payload[1].nbytes if payload else 0)
        self.in_flight += 1
        self.last_send = time.monotonic()

    def _reply(self, msg) -> None:
        if isinstance(msg, (Prepare, Swap)) and self.on_ring is not None:
            self.in_flight -= 1
            self.progress_at = time.monotonic()
            self.on_ring(msg)
            return
        if not isinstance(msg, Tokens):
            raise PipelineError(f"stage 0: unexpected {type(msg).__name__} from the last stage")
        self.in_flight -= 1
        self.progress_at = time.monotonic()
        self.words.extend(msg.staged)
        for st in msg.stats:
            self.stage_stats[st.stage] = st
        self._picks(msg.picks)

    def _picks(self, picks) -> None:
        for pick in picks:
            seq = self.active.get(pick.seq)
            if seq is None:
                continue
            if pick.error is not None:
                seq.error = pick.error
                self._finish(seq, "error")
            else:
                self._token(seq, pick)

    def _token(self, seq: Sequence, pick: Pick) -> None:
        now = time.perf_counter()
        token = pick.token
        if pick.prompt is not None and seq.on_prompt is not None:
            seq.on_prompt(seq, pick)
        if not seq.tokens:
            seq.t_first = now
        if seq.params.max_new_tokens == 0:  # the prompt's log-probabilities only
            self._finish(seq, "length")
            return
        seq.tokens.append(token)
        if seq.on_token is not None:
            seq.on_token(seq, pick)
        reason = None
        if self.eos is not None and token == self.eos:
            reason = "stop"
        elif (
            len(seq.tokens) >= seq.params.max_new_tokens
            or len(seq.prompt_ids) + len(seq.tokens) >= self.context
        ):
            reason = "length"
        elif seq.cancelled:
            reason = seq.cancel_reason
        if reason is None:
            self.ready.append(seq)
        else:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.t_done = time.perf_counter()
        if seq.t_admit:
            self.active.pop(seq.id, None)
            self._release(seq.lane)
        if seq.on_done is not None:
            seq.on_done(seq)


def _launch_order(seq: Sequence) -> tuple[bool, int]:
    """A micro-batch's order: its decodes first, by lane, then its prefills. Lanes are reused as
    sequences end, so the order sequences come back in drifts from the lanes' order; in this one
    the stage reads the decode rows' queries and cache rows as they lie (micro_batch._Decode.aligned)
    instead of picking them by index in every layer."""
    return (not seq.tokens, seq.lane)


def run_stage0(
    sched: Scheduler,
    *,
    more: Callable[[], bool],
    poll: Callable[[], bool] | None = None,
    after_step: Callable[[], None] | None = None,
    idle: Callable[[], None] | None = None,
) -> None:
    """Stage 0's loop: step the scheduler while `more()`.

    `poll()` takes outside input (the engine's requests) before each step, True when some came;
    `after_step()` runs after every step (the engine sends what the step produced); `idle()`
    runs when nothing happened and the pipeline is empty (the engine waits briefly for a request
    and keeps the ring's heartbeat). Time spent waiting for tokens counts as stage 0's recv wait.
    """
    backoff = Backoff()
    while more():
        took = poll() if poll is not None else False
        stepped = sched.step()
        if after_step is not None:
            after_step()
        if stepped or took:
            backoff.reset()
        elif idle is not None and not sched.busy:
            idle()
        else:
            t0 = time.perf_counter()
            backoff.pause()
            if sched.in_flight:
                sched.stats.recv_wait_s += time.perf_counter() - t0
