"""The API server's end of the engine channel (ZeroMQ): submit, cancel, and the engine's events
dispatched to the request they belong to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import zmq
import zmq.asyncio

from distlm.core.log import get_logger
from distlm.inference.messages import (
    Cancel,
    ChannelError,
    Error,
    Finish,
    Health,
    Prompt,
    Ready,
    Shutdown,
    Submit,
    Token,
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


class EngineClient:
    """The API server's end of the engine channel: it binds, stage 0 connects.

    A reader task dispatches Token / Finish / Error to the request they belong to (its Sink);
    Health updates the gauges. `fail()` ends every open request with a 503 and refuses new ones.
    """

    def __init__(self, requests_addr: str, events_addr: str, metrics: Metrics) -> None:
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
        self._rid = 0
        self._reader: asyncio.Task | None = None

    @property
    def outstanding(self) -> int:
        return sum(self.open_seqs.values())

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="engine-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
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
            self.ready, self.health_at = msg, time.monotonic()
            self.ready_event.set()
            self.metrics.up.set(1)
        elif isinstance(msg, Error) and msg.rid is None:
            self.fail(msg.message)
        elif isinstance(msg, (Prompt, Token, Finish, Error)):
            if isinstance(msg, (Finish, Error)) and msg.rid in self.open_seqs:
                self.open_seqs[msg.rid] -= 1
                self.metrics.open.set(self.outstanding)
                self.metrics.sequences.labels(
                    msg.reason if isinstance(msg, Finish) else "error"
                ).inc()
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
        self.metrics.open.set(0)

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
        self.metrics.open.set(self.outstanding)
        self._send(Submit(rid=rid, prompts=prompts, n=n, params=params))

    def cancel(self, rid: int, index: int | None = None) -> None:
        if self.failed is None and rid in self.open_seqs:
            self._send(Cancel(rid=rid, index=index))

    def forget(self, rid: int) -> None:
        self.queues.pop(rid, None)

    def shutdown(self, reason: str) -> None:
        self._send(Shutdown(reason=reason))
