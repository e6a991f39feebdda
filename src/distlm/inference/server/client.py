"""An API server process's end of its engine channel (ZeroMQ): attach, submit, cancel, and the
engine's events dispatched to the request they belong to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Protocol

import zmq
import zmq.asyncio

from distlm.core.log import get_logger
from distlm.inference.messages import (
    Attach,
    Cancel,
    ChannelError,
    Error,
    Finish,
    Health,
    Prompt,
    Ready,
    Shutdown,
    Submit,
    TokenBatch,
    Update,
    Updated,
    decode_all,
    encode,
)
from distlm.inference.sampling_params import SamplingParams
from distlm.inference.server.metrics import Metrics

log = get_logger(__name__)


class Sink(Protocol):
    """Where a request's events go as the reader takes them: an asyncio.Queue (a streamed
    request's handler takes each), or what applies them to a non-streamed request's answer."""

    def put_nowait(self, item, /) -> None: ...


_ATTACH_RETRY_S = 0.02  # until stage 0 has connected to this channel


class EngineClient:
    """An API server process's end of its engine channel (messages.endpoints): it binds, stage 0
    connects. Requests are numbered from `rid_base`, which the supervisor makes different for
    each start of the process, so events meant for a predecessor are never taken for its own.

    Once started it sends Attach until stage 0 takes it; stage 0 answers Ready, and only a Ready
    after the Attach makes the channel ready (stage 0 then reads this channel too). A reader task
    dispatches each token of a TokenBatch, and Prompt / Finish / Error, to the request they belong to (its Sink); Health updates
    the gauges. `fail()` ends every open request with a 503 and refuses new ones.
    """

    def __init__(self, channel: tuple[str, str], metrics: Metrics, *, rid_base: int = 0) -> None:
        requests_addr, events_addr = channel
        self.ctx = zmq.asyncio.Context()
        # requests go out on a plain socket, sent at once and never blocking (no high-water
        # mark: the queue limits bound them): zmq.asyncio's send machinery cost the API server
        # a fifth of its time per request
        self.push_ctx = zmq.Context()
        self.push = self.push_ctx.socket(zmq.PUSH)
        self.pull = self.ctx.socket(zmq.PULL)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(requests_addr)
        self.pull.bind(events_addr)
        self.metrics = metrics
        self.ready: Ready | None = None
        self.ready_event = asyncio.Event()
        self.failed: str | None = None
        self.health_at = 0.0
        self.health: Health | None = None
        self.queues: dict[int, Sink] = {}  # rid -> where its events go
        self.open_seqs: dict[int, int] = {}  # rid -> sequences not yet ended
        self._rid = rid_base
        self.attached = False
        self._reader: asyncio.Task | None = None
        self._attach: asyncio.Task | None = None

    @property
    def outstanding(self) -> int:
        return sum(self.open_seqs.values())

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), name="engine-reader")
        self._attach = loop.create_task(self._attaching(), name="engine-attach")

    async def _attaching(self) -> None:
        """Attach, sent once stage 0 has connected (a PUSH without a peer refuses a message)."""
        frame = encode(Attach(pid=os.getpid()))
        while self.failed is None:
            try:
                self.push.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(_ATTACH_RETRY_S)
                continue
            self.attached = True
            return

    async def close(self) -> None:
        for task in (self._reader, self._attach):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        self.push_ctx.term()

    async def _read(self) -> None:
        while True:
            frame = await self.pull.recv()
            try:
                msgs = decode_all(frame)
            except ChannelError as e:
                log.error("engine channel: %s (dropped)", e)
                continue
            for msg in msgs:
                try:
                    self._dispatch(msg)
                except Exception as e:  # a bug here must not leave requests waiting for ever
                    log.exception("engine channel: handling %s failed", type(msg).__name__)
                    self.fail(
                        f"the API server could not handle the engine's {type(msg).__name__} "
                        f"({type(e).__name__}: {e})"
                    )
                    return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Health):
            self.health, self.health_at = msg, time.monotonic()
            self.metrics.health(msg)
        elif isinstance(msg, Ready):
            if not self.attached:  # stage 0's word at its start: wait for the answer to Attach
                return
            self.ready, self.health_at = msg, time.monotonic()
            self.ready_event.set()
            self.metrics.up.set(1)
        elif isinstance(msg, Error) and msg.rid is None:
            self.fail(msg.message)
        elif isinstance(msg, Updated):
            q = self.queues.get(msg.rid)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, TokenBatch):
            queues = self.queues
            for token in msg.tokens():
                q = queues.get(token.rid)
                if q is not None:
                    q.put_nowait(token)
        elif isinstance(msg, (Prompt, Finish, Error)):
            if isinstance(msg, (Finish, Error)) and msg.rid in self.open_seqs:
                self.open_seqs[msg.rid] -= 1
                m = self.metrics
                m.open_sequences(self.outstanding)
                m.count(m.child(m.sequences, msg.reason if isinstance(msg, Finish) else "error"))
                if not self.open_seqs[msg.rid]:
                    del self.open_seqs[msg.rid]
            q = self.queues.get(msg.rid) if msg.rid is not None else None
            if q is not None:
                q.put_nowait(msg)
        else:
            log.error("engine channel: unexpected %s from stage 0", type(msg).__name__)

    def fail(self, reason: str, *, error: bool = True) -> None:
        """The pipeline is gone: every open request ends with a 503; new ones get it at once.

        `error`: False for a requested stop (logged as information, not as an error)."""
        if self.failed is None:
            self.failed = reason
            log.log(
                logging.ERROR if error else logging.INFO,
                "the pipeline is unavailable, answering 503: %s",
                reason,
            )
        self.metrics.up.set(0)
        for q in self.queues.values():
            q.put_nowait(Error(rid=None, index=None, status=503, message=reason))
        self.open_seqs.clear()
        self.metrics.open_sequences(0)

    def _send(self, msg) -> None:
        """Send now, without awaiting: callable from a cancelled task's cleanup too."""
        try:
            self.push.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.error("engine channel: sending %s failed: %s", type(msg).__name__, e)

    def new_rid(self) -> int:
        """The id of the next request."""
        self._rid += 1
        return self._rid

    def submit(
        self, rid: int, prompts: list[list[int]], n: int, params: SamplingParams, sink: Sink
    ) -> None:
        """Send request `rid` to stage 0; its events go to `sink`."""
        self.queues[rid] = sink
        self.open_seqs[rid] = len(prompts) * n
        self.metrics.open_sequences(self.outstanding)
        self._send(Submit(rid=rid, prompts=prompts, n=n, params=params))

    def send_update(self, rid: int, msg: Update, sink: Sink) -> None:
        """Send a weight update to stage 0; its Updated (or the pipeline's failure) goes to
        `sink`."""
        self.queues[rid] = sink
        self._send(msg)

    def cancel(self, rid: int, index: int | None = None) -> None:
        if self.failed is None and rid in self.open_seqs:
            self._send(Cancel(rid=rid, index=index))

    def forget(self, rid: int) -> None:
        self.queues.pop(rid, None)

    def shutdown(self, reason: str) -> None:
        self._send(Shutdown(reason=reason))
