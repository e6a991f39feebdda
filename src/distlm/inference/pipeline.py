"""Pipeline-parallel generation over MPI: one rank per stage, a ring of point-to-point messages.

    mpiexec -n 3 python workflow/scripts/infer.py --config results/config/inference.json \
        --model results/train/final --prompts config/prompts.txt \
        --generations results/inference/generations.jsonl --timing results/inference/timing.json

Stage 0 (rank 0) owns the scheduler: it admits sequences into *lanes* (one KV cache per lane on
every stage), packs ready lanes into micro-batches of at most ceil(lanes / stages) and keeps up to
`stages` micro-batches in flight, so different prompts occupy different stages at the same moment.
Hidden states flow stage -> stage + 1; the last stage picks each sequence's next token and sends the
tokens back to stage 0, which decides whether the sequence goes round again (decode) or finishes.

Every wait has a deadline: a rank that dies or hangs makes the others stop with an error that names
the stage they were waiting for (then MPI_Abort), never a hang. Stage 0 waits `inference.timeout_s`
for tokens to come back, the other stages twice that for their next message, so stage 0 (and in
serve mode the engine, which tells the API server to answer 503) is the first to notice. While the
pipeline is idle (serve mode) stage 0 sends an empty micro-batch round the ring as a heartbeat.

MPI errors are returned, not fatal (MPI_ERRORS_RETURN), and become PipelineErrors naming both stages.
A rank killed outright ends the whole job (the launcher kills the rest); in serve mode the API
server outside the job (`distlm.inference.api`) then answers 503.

The ring's messages are named types: Hello, Stop, Work (slots + hidden states) and Tokens (picks).
A pick that failed (SamplingError) carries its error, and fails that one sequence only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from distlm import DistlmError
from distlm.inference.prompts import RequestError, encode_prompt, read_prompts
from distlm.inference.sampling import (
    SamplingParams,
    new_generator,
    params_from_config,
    pick_token,
    prompt_logprobs,
    top_logprobs,
)
from distlm.inference.stage import Item, StageModel, load_stage
from distlm.io import atomic_path, write_json
from distlm.log import get_logger

log = get_logger(__name__)

TAG = 17
_SPIN = 200  # polls before a waiting rank starts to sleep between polls


class PipelineError(DistlmError):
    """A stage died or stopped answering: the message names the stage and the timeout."""


# ----------------------------------------------------------------------------- topology / links


@dataclass(frozen=True)
class PipelineTopology:
    """Where this rank sits in the ring of stages."""

    rank: int
    stages: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.stages - 1

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.stages

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.stages


@dataclass
class StageStats:
    """Where a stage's time went: forward passes, sends, and waiting for the previous stage."""

    stage: int
    compute_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    micro_batches: int = 0
    items: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        self.__init__(stage=self.stage)

    def brief(self) -> dict:
        """What /metrics shows per stage (cumulative seconds)."""
        return {
            "stage": self.stage,
            "compute_s": self.compute_s,
            "send_s": self.send_s,
            "recv_wait_s": self.recv_wait_s,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["comm_s"] = self.send_s + self.recv_wait_s
        return d


class Backoff:
    """Poll tightly for a while, then sleep in growing steps (up to 0.5 ms) so idle ranks yield the CPU."""

    def __init__(self) -> None:
        self.n = 0

    def reset(self) -> None:
        self.n = 0

    def pause(self) -> None:
        self.n += 1
        if self.n > _SPIN:
            time.sleep(min(5e-4, 1e-5 * (self.n - _SPIN)))


class Ring:
    """Messages to the next stage and from the previous one; every wait has a deadline.

    An MPI error (returned, not fatal: see mpi_pipeline) becomes a PipelineError naming both stages.
    """

    def __init__(
        self, comm, topo: PipelineTopology, *, timeout_s: float, stats: StageStats
    ) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.topo = topo
        self.timeout_s = timeout_s
        self.stats = stats
        self._mpi_error = MPI.Exception

    def _failed(self, e, peer: int) -> PipelineError:
        return PipelineError(
            f"stage {self.topo.rank}: MPI error with stage {peer}: {e.Get_error_string()} (it died?)"
        )

    def send(self, msg: Hello | Stop | Work | Tokens, nbytes: int = 0) -> None:
        t0 = time.perf_counter()
        try:
            req = self.comm.isend(msg, dest=self.topo.next, tag=TAG)
            self._poll(req.Test, f"stage {self.topo.next} did not take a message within")
        except self._mpi_error as e:
            raise self._failed(e, self.topo.next) from None
        self.stats.send_s += time.perf_counter() - t0
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    def _poll(self, done, what: str) -> None:
        """Wait until done() is true, at most timeout_s; then the peer is declared dead."""
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff()
        while not done():
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"stage {self.topo.rank}: {what} {self.timeout_s:g} s "
                    "(inference.timeout_s): it died or hangs"
                )
            backoff.pause()

    def ready(self) -> bool:
        try:
            return self.comm.Iprobe(source=self.topo.prev, tag=TAG)
        except self._mpi_error as e:
            raise self._failed(e, self.topo.prev) from None

    def take(self):
        try:
            return self.comm.recv(source=self.topo.prev, tag=TAG)
        except self._mpi_error as e:
            raise self._failed(e, self.topo.prev) from None

    def recv(self):
        """The next message from the previous stage, waiting at most timeout_s."""
        t0 = time.perf_counter()
        self._poll(self.ready, f"nothing from stage {self.topo.prev} for")
        msg = self.take()
        self.stats.recv_wait_s += time.perf_counter() - t0
        return msg


def to_wire(x: torch.Tensor) -> tuple[str, np.ndarray]:
    """A tensor as (dtype name, numpy array) in host memory; bfloat16 travels as its int16 bit pattern."""
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return "bfloat16", x.view(torch.int16).numpy()
    return str(x.dtype).removeprefix("torch."), x.numpy()


def from_wire(payload: tuple[str, np.ndarray]) -> torch.Tensor:
    name, arr = payload
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if name == "bfloat16" else t


# ----------------------------------------------------------------------------- ring messages


@dataclass(frozen=True)
class Fork:
    """A sibling of an n > 1 request: its own lane and sampling, its parent's prefill (KV shared)."""

    seq: int
    lane: int
    params: SamplingParams


@dataclass(frozen=True)
class Slot:
    """One sequence's part of a micro-batch; sampling parameters travel with the prefill, once.

    `prompt`: the prompt's token ids, on a prefill that asks for the prompt's log-probabilities
    (the last stage scores each prompt token from the same forward pass)."""

    item: Item
    params: SamplingParams | None = None
    forks: tuple[Fork, ...] = ()
    prompt: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Pick:
    """The last stage's choice for one sequence: a token (and its log-probabilities) or an error.

    `prompt`: on the prefill, when asked, (log-probability, top alternatives) of prompt tokens
    1 .. T-1 (the first has none)."""

    seq: int
    token: int = -1
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    error: str | None = None
    prompt: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None


@dataclass(frozen=True)
class Hello:
    """Round the ring once at start: each stage adds where it runs."""

    infos: list[dict]


@dataclass(frozen=True)
class Stop:
    """Round the ring once at the end: each stage adds its StageStats and stops."""

    stats: list[dict]


@dataclass(frozen=True)
class Work:
    """A micro-batch (empty: a heartbeat) and the previous stage's output for it."""

    slots: tuple[Slot, ...]
    payload: tuple[str, np.ndarray] | None = None
    stats: tuple[dict, ...] = ()  # each later stage adds its StageStats.brief() on the way


@dataclass(frozen=True)
class Tokens:
    """The last stage's picks for one micro-batch, back to stage 0."""

    picks: tuple[Pick, ...]
    stats: tuple[dict, ...] = ()


def fork_caches(model: StageModel, slots: tuple[Slot, ...]) -> None:
    """After a prefill, each fork's lane gets the parent's KV cache (n > 1 shares the prefill)."""
    for sl in slots:
        for f in sl.forks:
            model.fork(sl.item.lane, f.lane)


# ----------------------------------------------------------------------------- sequences


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


class Sampler:
    """The last stage's per-lane sampling state (parameters and random generator)."""

    def __init__(self) -> None:
        self.lanes: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}

    def start(self, lane: int, params: SamplingParams) -> None:
        self.lanes[lane] = (params, new_generator(params))

    def pick(
        self, seq: int, lane: int, logits: torch.Tensor, prompt=None, argmax: int | None = None
    ) -> Pick:
        """A token for one sequence; an error in it (SamplingError, a bug) fails that one only.

        `prompt`: the prompt's log-probabilities (sampling.prompt_logprobs) to carry back;
        `argmax`: the row's argmax when its logits are finite, taken for the whole micro-batch
        at once (what pick_token would choose for a greedy sequence)."""
        try:
            params, gen = self.lanes[lane]
            if params.greedy and argmax is not None:
                token = argmax
            else:
                token = pick_token(logits, params, gen)
            if params.logprobs is None:
                return Pick(seq, token, prompt=prompt)
            lp, top = top_logprobs(logits, token, params.logprobs)
            return Pick(seq, token, lp, tuple(top), prompt=prompt)
        except Exception as e:
            log.error("sequence %d (lane %d): sampling failed: %s", seq, lane, e)
            return Pick(seq, error=f"sampling failed: {e}")


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


def _every(slots: tuple[Slot, ...]) -> frozenset[int]:
    """The slots whose every position the last stage scores: prefills asking for the prompt's
    log-probabilities."""
    return frozenset(i for i, sl in enumerate(slots) if sl.prompt is not None)


def last_stage(model: StageModel, sampler: Sampler, slots: tuple[Slot, ...], x) -> list[Pick]:
    """The last stage's forward pass and picks: one pass scores the prompts that ask for it."""
    out = model([sl.item for sl in slots], x, every=_every(slots))
    logits, rest = out if isinstance(out, tuple) else (out, {})
    logits = logits.float().cpu()  # (B, V); the generators live on the CPU
    # greedy picks for the whole micro-batch at once, not per sequence; a row with no finite
    # logit gets None (pick_token then fails that sequence alone)
    if bool(torch.isfinite(logits.sum())):  # every logit finite: one reduction says so
        finite = [True] * len(slots)
    else:
        finite = torch.isfinite(logits).any(dim=1).tolist()
    best = [b if ok else None for b, ok in zip(logits.argmax(dim=1).tolist(), finite)]
    picks = []
    for i, sl in enumerate(slots):
        if sl.item.pos == 0:
            sampler.start(sl.item.lane, sl.params)
            for f in sl.forks:
                sampler.start(f.lane, f.params)
        prompt = None
        if sl.prompt is not None:
            prompt = prompt_logprobs(
                rest[i].cpu(), list(sl.prompt[1:]), sl.params.prompt_logprobs or 0
            )
        picks.append(sampler.pick(sl.item.seq, sl.item.lane, logits[i], prompt, best[i]))
        picks.extend(sampler.pick(f.seq, f.lane, logits[i], prompt, best[i]) for f in sl.forks)
    return picks


# ----------------------------------------------------------------------------- stage 0


class Scheduler:
    """Stage 0: lanes, micro-batches, and the decision to continue or finish each sequence."""

    def __init__(
        self,
        model: StageModel,
        ring: Ring | None,
        topo: PipelineTopology,
        *,
        lanes: int,
        eos_token_id: int | None,
        context: int,
        timeout_s: float,
        stats: StageStats,
    ) -> None:
        self.model, self.ring, self.topo = model, ring, topo
        self.lanes = lanes
        self.cap = math.ceil(lanes / topo.stages)  # sequences per micro-batch
        self.eos = eos_token_id
        self.context = context
        self.timeout_s = timeout_s
        self.stats = stats
        self.sampler = Sampler()
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.active: dict[int, Sequence] = {}
        self.free = list(range(lanes - 1, -1, -1))
        self.inflight = 0
        self.launching = True  # False: only collect what is in the ring (shutting down)
        self.progress_at = time.monotonic()
        self.last_send = time.monotonic()
        self._next_id = 0
        self.stage_stats: dict[int, dict] = {}  # later stages' StageStats.brief(), as last seen

    # -- public

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def submit(self, seq: Sequence) -> None:
        seq.t_submit = seq.t_submit or time.perf_counter()
        for sib in seq.siblings:
            sib.t_submit = seq.t_submit
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence: at once when it is not in the ring, else when its token comes back."""
        if seq.finish_reason is not None:
            return
        seq.cancelled = True
        for queue in (self.waiting, self.ready):
            if seq in queue:
                queue.remove(seq)
                if queue is self.waiting:  # its siblings have not found lanes: they queue now
                    self.waiting.extendleft(reversed(seq.siblings))
                    seq.siblings = []
                self._finish(seq, "cancelled")
                return

    @property
    def lanes_busy(self) -> int:
        return self.lanes - len(self.free)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.ready or self.inflight)

    def step(self) -> bool:
        """Do what can be done now without waiting; False when nothing could (caller pauses)."""
        did = False
        while self.ring is not None and self.inflight and self.ring.ready():
            self._reply(self.ring.take())
            did = True
        while self.launching and self.waiting and self.free:
            seq = self.waiting.popleft()
            if seq.cancelled:
                self._finish(seq, "cancelled")
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
        if self.launching and self.ready and self.inflight < self.topo.stages:
            batch = [self.ready.popleft() for _ in range(min(self.cap, len(self.ready)))]
            self._launch(batch)
            return True
        if self.inflight and not did and time.monotonic() - self.progress_at > self.timeout_s:
            raise PipelineError(
                f"stage 0: no tokens back from the pipeline (stages 1-{self.topo.stages - 1}) for "
                f"{self.timeout_s:g} s (inference.timeout_s): a stage died or hangs"
            )
        return did

    def heartbeat(self, every_s: float) -> None:
        """When idle, send an empty micro-batch round the ring, so every stage knows the others live."""
        if self.ring is not None and not self.busy and time.monotonic() - self.last_send > every_s:
            self._send_work((), None)

    def hello(self) -> list[dict]:
        """Each stage adds where it runs (host, pid, layers); stage 0 gets the list back."""
        infos = [stage_info(self.model)]
        if self.ring is None:
            return infos
        self.ring.send(Hello(infos))
        return self._expect(Hello).infos

    def stop(self) -> list[dict]:
        """End the workers; each adds its StageStats on the way round."""
        stats = [self.stats.to_dict()]
        if self.ring is None:
            return stats
        self.ring.send(Stop(stats))
        msg = self.ring.recv()
        while isinstance(msg, Tokens):  # a heartbeat still on its way
            msg = self.ring.recv()
        if not isinstance(msg, Stop):
            raise PipelineError(f"stage 0: expected Stop back, got {type(msg).__name__}")
        return msg.stats

    def _expect(self, kind: type):
        msg = self.ring.recv()
        if not isinstance(msg, kind):
            raise PipelineError(f"stage 0: expected {kind.__name__}, got {type(msg).__name__}")
        return msg

    def fail_all(self, reason: str) -> list[Sequence]:
        """The pipeline is gone: every sequence not yet finished, removed from the scheduler."""
        seqs = list(self.waiting) + list(self.active.values())
        seqs += [sib for s in self.waiting for sib in s.siblings]
        self.waiting.clear()
        self.ready.clear()
        self.active.clear()
        return seqs

    # -- internals

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
        if self.ring is None:  # a one-stage pipeline: this rank is also the last stage
            out = last_stage(self.model, self.sampler, slots, x)
        else:
            out = self.model(items, x)
        fork_caches(self.model, slots)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.micro_batches += 1
        self.stats.items += len(items)
        for s in batch:
            s.forks = []
        if self.ring is None:
            self._picks(out)
            self.progress_at = time.monotonic()
        else:
            self._send_work(slots, out)

    def _send_work(self, slots: tuple[Slot, ...], out) -> None:
        payload = to_wire(out) if out is not None else None
        if self.inflight == 0:
            self.progress_at = time.monotonic()
        self.ring.send(Work(slots, payload), payload[1].nbytes if payload else 0)
        self.inflight += 1
        self.last_send = time.monotonic()

    def _reply(self, msg) -> None:
        if not isinstance(msg, Tokens):
            raise PipelineError(f"stage 0: unexpected {type(msg).__name__} from the last stage")
        self.inflight -= 1
        self.progress_at = time.monotonic()
        for st in msg.stats:
            self.stage_stats[st["stage"]] = st
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
            reason = "cancelled"
        if reason is None:
            self.ready.append(seq)
        else:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.t_done = time.perf_counter()
        if seq.t_admit:
            self.active.pop(seq.id, None)
            self.free.append(seq.lane)
        if seq.on_done is not None:
            seq.on_done(seq)


# ----------------------------------------------------------------------------- stages 1..S-1


def worker_loop(model: StageModel, ring: Ring, stats: StageStats) -> None:
    """A later stage: forward what arrives, pass it on (or the picked tokens back); until stop."""
    sampler = Sampler()
    last = ring.topo.is_last
    while True:
        msg = ring.recv()
        if isinstance(msg, Hello):
            ring.send(Hello(msg.infos + [stage_info(model)]))
            stats.reset()  # count the steady state, not the wait for the others to load
        elif isinstance(msg, Stop):
            ring.send(Stop(msg.stats + [stats.to_dict()]))
            return
        elif isinstance(msg, Work):
            out = None
            if msg.slots:
                items = [sl.item for sl in msg.slots]
                t0 = time.perf_counter()
                x = from_wire(msg.payload)
                out = last_stage(model, sampler, msg.slots, x) if last else model(items, x)
                fork_caches(model, msg.slots)
                stats.compute_s += time.perf_counter() - t0
                stats.micro_batches += 1
                stats.items += len(items)
            seen = msg.stats + (stats.brief(),)
            if last:
                ring.send(Tokens(tuple(out or ()), seen))
            else:
                wire = to_wire(out) if out is not None else None
                ring.send(Work(msg.slots, wire, seen), wire[1].nbytes if wire else 0)
        else:
            raise PipelineError(f"stage {ring.topo.rank}: unexpected {type(msg).__name__}")


def stage_info(model: StageModel) -> dict:
    return {
        "stage": model.stage,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "layers": [model.start, model.end],
        "threads": torch.get_num_threads(),
        "device": str(model.device),
    }


# ----------------------------------------------------------------------------- running a pipeline


@dataclass
class Pipeline:
    """This rank's part of a running pipeline (stage 0 gets the scheduler and the tokenizer)."""

    topo: PipelineTopology
    model: StageModel
    ring: Ring | None
    stats: StageStats
    scheduler: Scheduler | None = None
    tokenizer: object = None
    context: int = 0
    eos_token_id: int | None = None
    infos: list[dict] = field(default_factory=list)


def host_ranks(comm) -> tuple[int, int, bool]:
    """(this rank's index among the ranks on its host, how many ranks share the host, whether
    stage 0 is one of them)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        with_first = bool(node.allreduce(int(comm.Get_rank() == 0), op=MPI.SUM))
        return node.Get_rank(), node.Get_size(), with_first
    finally:
        node.Free()


def set_threads(local_size: int, *, reserve: int = 0) -> int:
    """Share the thread budget between the ranks on this host; the threads each rank gets.

    The budget is OMP_NUM_THREADS when set (Snakemake sets it to the rule's `threads`, a total for
    the job), else the host's cores, less `reserve` for another process of the job on this host
    (serve: the API server, a busy Python process beside stage 0); each rank on the host gets an
    equal part, at least one thread.
    """
    budget = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    threads = max(1, (budget - reserve) // local_size)
    torch.set_num_threads(threads)
    return threads


@contextlib.contextmanager
def mpi_pipeline(
    icfg: dict, model_dir: str | Path, *, device: str = "cpu", serve: bool = False
) -> Iterator[Pipeline]:
    """Start this rank's stage; on any error log it and MPI_Abort, so no rank waits for ever.

    `device` is runtime.device: cpu, cuda (one GPU per rank on a host) or auto; never a fallback.
    `serve`: the API server runs beside stage 0, so the ranks on its host leave it one thread
    of the budget (on 2 cores, a one-stage engine with 1 thread served 10-30% more tokens than
    with 2, whose threads took turns on the cores with the API server's).
    """
    from mpi4py import MPI

    from distlm.dist import resolve_device
    from distlm.lifeline import bind_to_launcher

    bind_to_launcher()  # this rank dies with mpiexec's proxy (or srun's step), batch or serve
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    topo = PipelineTopology(comm.Get_rank(), comm.Get_size())
    try:
        local_rank, local_size, with_first = host_ranks(comm)
        set_threads(local_size, reserve=1 if serve and with_first else 0)
        stats = StageStats(stage=topo.rank)
        model = load_stage(
            model_dir, topo.rank, world=topo.stages, device=resolve_device(device, local_rank)
        )
        # Stage 0 gives up first (its engine tells the API server, which answers 503); the
        # other stages wait twice as long, so they also end when stage 0 itself dies or hangs.
        wait_s = icfg["timeout_s"] * (1 if topo.is_first else 2)
        ring = Ring(comm, topo, timeout_s=wait_s, stats=stats) if topo.stages > 1 else None
        pipe = Pipeline(topo, model, ring, stats)
        if topo.is_first:
            from distlm.data import load_tokenizer

            pipe.tokenizer = load_tokenizer(model_dir)
            pipe.context = model.config.n_positions
            pipe.eos_token_id = pipe.tokenizer.eos_token_id
            pipe.scheduler = Scheduler(
                model,
                ring,
                topo,
                lanes=icfg["lanes"],
                eos_token_id=pipe.eos_token_id,
                context=pipe.context,
                timeout_s=icfg["timeout_s"],
                stats=stats,
            )
            pipe.infos = pipe.scheduler.hello()
            stats.reset()
            log.info("pipeline of %d stages up: %s", topo.stages, json.dumps(pipe.infos))
        yield pipe
    except KeyboardInterrupt:
        log.warning("interrupted")
        sys.stderr.flush()
        os._exit(130)
    except BaseException as e:  # any failure must take the whole job down
        if isinstance(e, DistlmError):
            log.error("stage %d failed: %s", topo.rank, e)
        else:
            log.exception("stage %d failed", topo.rank)
        for h in log.handlers + log.parent.handlers:
            h.flush()
        comm.Abort(1)


def run_workers(pipe: Pipeline) -> bool:
    """Stages 1..S-1 serve until stage 0 stops them; True when this rank is stage 0."""
    if pipe.topo.is_first:
        return True
    worker_loop(pipe.model, pipe.ring, pipe.stats)
    return False


def drive(
    sched: Scheduler, more: Callable[[], bool], *, on_idle: Callable[[], None] | None = None
) -> None:
    """Step the scheduler while `more()`; time spent waiting for tokens counts as stage 0's recv wait."""
    backoff = Backoff()
    while more():
        if sched.step():
            backoff.reset()
            continue
        if on_idle is not None and not sched.busy:
            on_idle()
            continue
        t0 = time.perf_counter()
        backoff.pause()
        if sched.inflight:
            sched.stats.recv_wait_s += time.perf_counter() - t0


def generate_batch(
    pipe: Pipeline, prompts: list[str], icfg: dict, *, source: str = "prompts"
) -> tuple[list[dict], dict]:
    """Stage 0: run every prompt through the pipeline; (generation records, timing summary)."""
    sched, tok = pipe.scheduler, pipe.tokenizer
    seqs, dropped = [], []
    for i, text in enumerate(prompts):
        try:
            params = params_from_config(icfg, context=pipe.context, seed_offset=i)
        except RequestError as e:  # named as the request field; say which config key it is
            raise DistlmError(
                f"config inference.{str(e).replace('max_tokens', 'max_new_tokens')}"
            ) from None
        try:
            ids, cut = encode_prompt(
                tok,
                text,
                context=pipe.context,
                max_new_tokens=params.max_new_tokens,
                overflow=icfg["prompt_overflow"],
            )
        except RequestError as e:
            raise DistlmError(f"{source}: prompt {i + 1}: {e}") from None
        if cut:
            log.warning(
                "%s: prompt %d: dropped its first %d tokens to fit the context", source, i + 1, cut
            )
        seqs.append(Sequence(sched.new_id(), ids, params))
        dropped.append(cut)
    t0 = time.perf_counter()
    for s in seqs:
        s.t_submit = t0
        sched.submit(s)
    drive(sched, lambda: sched.busy)
    wall = time.perf_counter() - t0
    records = []
    for i, (text, s, cut) in enumerate(zip(prompts, seqs, dropped)):
        records.append(
            {
                "index": i,
                "prompt": text,
                "text": tok.decode(s.tokens, skip_special_tokens=True),
                "tokens": len(s.tokens),
                "token_ids": s.tokens,
                "finish_reason": s.finish_reason,
                "prompt_tokens": len(s.prompt_ids),
                "prompt_truncated_tokens": cut,
                **{k: v for k, v in s.timing().items() if k != "tokens"},
            }
        )
    total = sum(len(s.tokens) for s in seqs)
    timing = {
        "stages": pipe.topo.stages,
        "lanes": icfg["lanes"],
        "micro_batch_size": sched.cap,
        "prompts": len(seqs),
        "tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else None,
        "ttft_s": {
            "mean": sum(s.t_first - s.t_submit for s in seqs) / len(seqs),
            "max": max(s.t_first - s.t_submit for s in seqs),
        },
        "per_prompt": [{"index": r["index"], **seqs[i].timing()} for i, r in enumerate(records)],
    }
    return records, timing


def run_batch(
    icfg: dict, *, model_dir, prompts_path, generations_path, timing_path, device: str = "cpu"
) -> None:
    """The inference stage: every rank calls this; stage 0 writes the generations and the timing."""
    with mpi_pipeline(icfg, model_dir, device=device) as pipe:
        if not run_workers(pipe):
            return
        prompts = read_prompts(prompts_path)
        records, timing = generate_batch(pipe, prompts, icfg, source=str(prompts_path))
        timing["per_stage"] = pipe.scheduler.stop()
        timing["hosts"] = pipe.infos
        timing["model"] = str(model_dir)
        with atomic_path(generations_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        write_json(timing_path, timing)
        log.info(
            "%d prompts, %d tokens in %.2f s: %.1f tokens/s over %d stages",
            timing["prompts"],
            timing["tokens"],
            timing["wall_s"],
            timing["tokens_per_s"] or 0,
            timing["stages"],
        )
