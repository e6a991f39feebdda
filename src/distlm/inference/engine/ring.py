"""The ring of stages: a rank's link to the next and previous stage (where it sits is its
distlm.runtime.dist.Topology, backend MPI), and the named, versioned messages that travel round it (MPI
point-to-point, every wait with a deadline).

    stage 0 --Work--> stage 1 --Work--> ... --Work--> last stage --Tokens--> stage 0
    Hello and Stop go round once each, at start (where each stage runs) and at the end (its stats).
    A live update of the weights (engine/update.py): Prepare goes round (each stage starts staging
    its part), each stage's Prepared rides the next Work / Tokens past it, then Swap goes round
    (each stage switches, or drops what it staged). Messages keep their order, so a Swap falls
    between the same two micro-batches on every stage.

Each message goes out as the pair (RING_VERSION, message), pickled by mpi4py. The engine channel
(messages.py) and the documents (distlm.core.documents) use msgpack and JSON because other programs
could read them; the ring links ranks of one MPI job only, and its Work messages carry hidden
states as numpy arrays, which pickle protocol 5 moves without a copy through a JSON-like encoding.
So the ring keeps pickle, and the version in front of every message is what catches ranks started
from two different installs: a message of another version, or of a type that is not a ring
message, raises PipelineError naming both stages instead of being misread.

MPI errors are returned, not fatal (MPI_ERRORS_RETURN, set by bootstrap.mpi_pipeline), and become
PipelineErrors naming both stages.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch

from distlm import DistlmError
from distlm.inference.engine.pipeline_stage import Item, StageModel
from distlm.inference.engine.weight_sources import Source
from distlm.inference.sampling_params import SamplingParams
from distlm.inference.stats import StageBrief, StageInfo, StageStats
from distlm.runtime.dist import Topology

# 1: typed StageInfo / StageBrief / StageStats, Work.release
# 2: StageBrief's device_s and micro_batches
# 3: Prepare, Swap; Work.staged, Tokens.staged (live weight updates)
# 4: Prepare.source may be a PushOffer; Prepare.stages
# 5: a PushOffer carries its key
# 6: a PushOffer names its transport and the sender's device
RING_VERSION = 6
TAG = 17
_SPIN = 200  # polls before a waiting rank starts to sleep between polls
_NAP_S = 5e-4  # the longest sleep between polls while messages come often
_IDLE_AFTER_S = 0.2  # nothing for this long: the pipeline is idle, poll every _IDLE_NAP_S
_IDLE_NAP_S = 5e-3


class PipelineError(DistlmError):
    """A stage died or stopped answering: the message names the stage and the timeout."""


# ----------------------------------------------------------------------------- links


class Backoff:
    """Poll tightly for a while, then sleep in growing steps (up to 0.5 ms) so waiting ranks yield
    the CPU; after 0.2 s with nothing, poll every 5 ms, so that an idle stage takes next to no CPU
    and the first message after a pause waits at most 5 ms more (docs/serving.md)."""

    def __init__(self) -> None:
        self.n = 0
        self.since = 0.0

    def reset(self) -> None:
        self.n = 0

    def pause(self) -> None:
        self.n += 1
        if self.n <= _SPIN:
            return
        if self.n == _SPIN + 1:
            self.since = time.monotonic()
        elif time.monotonic() - self.since > _IDLE_AFTER_S:
            time.sleep(_IDLE_NAP_S)
            return
        time.sleep(min(_NAP_S, 1e-5 * (self.n - _SPIN)))


class Ring:
    """Messages to the next stage and from the previous one; every wait has a deadline.

    An MPI error (returned, not fatal: see mpi_pipeline) becomes a PipelineError naming both stages.
    """

    def __init__(self, comm, topo: Topology, *, timeout_s: float, stats: StageStats) -> None:
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

    def send(self, msg: RingMessage, nbytes: int = 0) -> None:
        t0 = time.perf_counter()
        try:
            req = self.comm.isend((RING_VERSION, msg), dest=self.topo.next, tag=TAG)
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

    def take(self) -> RingMessage:
        try:
            got = self.comm.recv(source=self.topo.prev, tag=TAG)
        except self._mpi_error as e:
            raise self._failed(e, self.topo.prev) from None
        return self._open(got)

    def _open(self, got) -> RingMessage:
        return open_envelope(got, rank=self.topo.rank, prev=self.topo.prev)

    def recv(self) -> RingMessage:
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

    infos: tuple[StageInfo, ...]


@dataclass(frozen=True)
class Stop:
    """Round the ring once at the end: each stage adds its StageStats and stops."""

    stats: tuple[StageStats, ...]


@dataclass(frozen=True)
class Prepare:
    """Round the ring: each stage starts staging its part of update `update`'s weights (read,
    verified, built beside the served ones, in a thread) and passes this on at once."""

    update: int
    source: Source  # a folder's files, or a sender's offer (weight_sources: FromDisk, FromPush)
    tied: dict[str, str]  # a tied copy -> its source (the running pipeline's manifest)
    stages: int  # how many stages the pipeline has


@dataclass(frozen=True)
class Prepared:
    """A stage's word on its staging of `update`: `error` None when its part is ready."""

    update: int
    stage: int
    error: str | None
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Swap:
    """Round the ring: each stage switches to update `update`'s staged weights (`commit`), or
    drops them; between the micro-batch before this message and the one after, on every stage."""

    update: int
    commit: bool


@dataclass(frozen=True)
class Work:
    """A micro-batch (empty: a heartbeat) and the previous stage's output for it."""

    slots: tuple[Slot, ...]
    payload: tuple[str, np.ndarray] | None = None
    stats: tuple[StageBrief, ...] = ()  # each later stage adds its StageStats.brief() on the way
    # lanes whose sequences ended since the last message: each stage frees their KV cache (and
    # the last stage their sampling state) before it runs this micro-batch
    release: tuple[int, ...] = ()
    staged: tuple[Prepared, ...] = ()  # stages' words on an update's staging, as they pass


@dataclass(frozen=True)
class Tokens:
    """The last stage's picks for one micro-batch, back to stage 0."""

    picks: tuple[Pick, ...]
    stats: tuple[StageBrief, ...] = ()
    staged: tuple[Prepared, ...] = ()


RingMessage = Hello | Stop | Work | Tokens | Prepare | Swap
RING_KINDS = (Hello, Stop, Work, Tokens, Prepare, Swap)


def open_envelope(got, *, rank: int, prev: int) -> RingMessage:
    """The message inside a (RING_VERSION, message) pair from stage `prev`; PipelineError for
    another version or anything that is not a ring message."""
    where = f"stage {rank}: from stage {prev}"
    if not (isinstance(got, tuple) and len(got) == 2):
        raise PipelineError(f"{where}: {type(got).__name__} is not a (version, message) pair")
    version, msg = got
    if version != RING_VERSION:
        raise PipelineError(
            f"{where}: ring message version {version!r}, this stage speaks {RING_VERSION} "
            "(ranks started from different distlm installs?)"
        )
    if type(msg) not in RING_KINDS:
        raise PipelineError(f"{where}: {type(msg).__name__} is not a ring message")
    return msg


def stage_info(model: StageModel) -> StageInfo:
    """Where this rank's stage runs (its part of the Hello round)."""
    return StageInfo(
        stage=model.stage,
        host=socket.gethostname(),
        pid=os.getpid(),
        layers=(model.cut.start, model.cut.end),
        threads=torch.get_num_threads(),
        device=str(model.device),
    )
