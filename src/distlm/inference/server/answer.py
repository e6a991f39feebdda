"""Answering a prepared request (completions or chat: the job's shape says how the answer looks):
submitted to the engine, then one JSON answer or a stream of server-sent events; a client gone or
a deadline passed cancels the request's sequences.

The engine channel's reader applies each event to its request's answer as it takes it (a sink:
_Collect, _Follow), so a handler wakes once when its answer is done (stream false), or once per
engine step at most when a stream chunk is due (a choice has `serve.stream_interval` tokens not
yet sent, or ended), and then writes one chunk per choice changed in one write. Answers and chunks
are serialized by pydantic's Rust serializer (model_dump_json), not through Python dicts."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from distlm.core.log import get_logger
from distlm.inference.messages import Token
from distlm.inference.server.client import EngineClient
from distlm.inference.server.errors import ApiError, error_doc
from distlm.inference.server.metrics import Metrics
from distlm.inference.server.prepare import Job
from distlm.inference.server.render import Answer
from distlm.inference.server.responses import Usage
from distlm.settings import EngineSettings, ServeSettings

log = get_logger(__name__)


@dataclass(frozen=True)
class Answering:
    """What answering a prepared request needs: the engine, the room in its queue and the
    request deadline, the model's name, the tokenizer, the metrics and the stream interval."""

    engine: EngineClient
    room: int  # sequences open at once: inference.lanes + serve.max_queued_sequences
    request_timeout_s: float  # serve.request_timeout_s
    model_id: str
    tokenizer: Any  # a transformers tokenizer
    metrics: Metrics
    stream_interval: int = 1  # serve.stream_interval

    @classmethod
    def of(
        cls,
        serve: ServeSettings,
        inference: EngineSettings,
        *,
        engine: EngineClient,
        model_id: str,
        tokenizer: Any,
        metrics: Metrics,
    ) -> Answering:
        return cls(
            engine,
            inference.lanes + serve.max_queued_sequences,
            serve.request_timeout_s,
            model_id,
            tokenizer,
            metrics,
            serve.stream_interval,
        )


async def run_completion(st: Answering, request: Request, job: Job):
    engine = st.engine
    sequences = len(job.ids) * job.n
    if sequences > st.room - engine.outstanding:
        raise ApiError(
            429,
            f"the queue is full ({engine.outstanding} sequences open, at most "
            f"{st.room}: inference.lanes + serve.max_queued_sequences); retry later",
            headers={"Retry-After": "1"},
        )
    t0 = time.perf_counter()
    st.metrics.count(st.metrics.prompt_tokens, sum(len(i) for i in job.ids))
    rid = engine.new_rid()
    ready = engine.ready  # a route takes a request only once stage 0 said Ready
    if ready is None:
        raise ApiError(503, "the pipeline is unavailable: the pipeline is starting")
    answer = Answer(
        job,
        rid,
        t0,
        tokenizer=st.tokenizer,
        metrics=st.metrics,
        cancel=engine.cancel,
        fingerprint=lambda: (engine.ready or ready).fingerprint,
    )
    info = request.scope.setdefault("distlm", {})
    info["rid"] = rid
    deadline = time.monotonic() + st.request_timeout_s
    if job.stream:
        follow = _Follow(answer, st.stream_interval)
        engine.submit(rid, job.ids, job.n, job.params, follow)
        return StreamingResponse(
            _stream(st, answer, follow, deadline, info),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    collect = _Collect(answer)
    engine.submit(rid, job.ids, job.n, job.params, collect)
    return await _complete(st, request, answer, collect, deadline, info)


async def _within(deadline: float, what: str, awaitable):
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, left)):
            return await awaitable
    except TimeoutError:
        raise ApiError(504, _TIMED_OUT.format(what=what)) from None


_TIMED_OUT = "{what} not done within the request timeout (serve.request_timeout_s)"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: the next message is a disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _finish(st: Answering, answer: Answer, info: dict) -> None:
    st.engine.forget(answer.rid)
    info["tokens"] = sum(len(c.tokens) for c in answer.choices)
    if answer.t_first is not None:
        info["ttft_s"] = answer.t_first - answer.t0
    st.metrics.observe(st.metrics.e2e, time.perf_counter() - answer.t0)


_GONE = object()  # to a request's sink: its client went away


class _Collect:
    """A non-streamed request's sink: the engine channel's reader applies each event to the
    answer as it takes it (so the metrics' times are the events' arrival, as with a queue),
    and the handler wakes once, when every choice has ended, the pipeline failed or the client
    went away, not once per engine step."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put_nowait(self, msg, /) -> None:
        if self.done.done():  # answered, timed out or gone: what still comes is not needed
            return
        if msg is _GONE:
            self.done.set_result(_GONE)
            return
        try:
            self.answer.event(msg)
        except Exception as e:  # the pipeline failed (ApiError 503), or a bug: this request fails
            self.done.set_exception(e)
            return
        if not self.answer.left:
            self.done.set_result(None)


class _Follow:
    """A streamed request's sink: the engine channel's reader applies each event to the answer
    as it takes it, and wakes the handler when a chunk is due: a choice has `interval` tokens not
    yet sent, ended, or got its prompt's log-probabilities, or the pipeline failed. The reader
    takes a whole engine step's frame before the handler runs, so the handler wakes once a step
    at most, whatever the number of choices or tokens."""

    def __init__(self, answer: Answer, interval: int) -> None:
        self.answer, self.interval = answer, interval
        self.changed: dict[int, None] = {}  # choices changed since the last chunk, in order
        self.unsent = [0] * len(answer.choices)  # their tokens not yet in a chunk
        self.failure: BaseException | None = None
        self.expired = False  # the request's deadline passed (`expire`, one timer a stream)
        self.due = asyncio.Event()

    def expire(self) -> None:
        """The deadline's timer: the handler wakes, and ends the stream with a 504."""
        self.expired = True
        self.due.set()

    def put_nowait(self, msg, /) -> None:
        if self.failure is not None:
            return
        try:
            changed = self.answer.event(msg)
        except Exception as e:  # the pipeline failed (ApiError 503), or a bug: the stream ends
            self.failure = e
            self.due.set()
            return
        for i in changed:
            self.changed[i] = None
            if isinstance(msg, Token):
                self.unsent[i] += 1
            c = self.answer.choices[i]
            if (
                not isinstance(msg, Token)
                or c.reason is not None
                or (self.unsent[i] >= self.interval)
            ):
                self.due.set()

    def take(self) -> list[int]:
        """The choices changed since the last chunk (the handler writes them now)."""
        out = list(self.changed)
        self.changed.clear()
        for i in out:
            self.unsent[i] = 0
        self.due.clear()
        return out


async def _complete(
    st: Answering, request: Request, answer: Answer, collect: _Collect, deadline, info
):
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda f: f.cancelled() or collect.put_nowait(_GONE))
    try:
        if await _within(deadline, "the completion", collect.done) is _GONE:
            st.engine.cancel(answer.rid)
            info["cancelled"] = "client gone"
            return Response(status_code=499)  # nobody reads it; the access log does
    except ApiError as e:
        st.engine.cancel(answer.rid)
        if e.status == 504:
            info["cancelled"] = "timed out"
        raise
    finally:
        gone.cancel()
        _finish(st, answer, info)
    failed = [c for c in answer.choices if c.error is not None]
    if failed:
        raise ApiError(500, f"choice {failed[0].index}: {failed[0].error}")
    shape = answer.job.shape
    out = shape.document(
        answer,
        id=f"{shape.prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=st.model_id,
        choices=[shape.choice(answer, c.index) for c in answer.choices],
        system_fingerprint=answer.fingerprint,
    )
    return Response(out.model_dump_json(), media_type="application/json")


async def _stream(st: Answering, answer: Answer, follow: _Follow, deadline, info):
    """Server-sent events; a client gone mid-stream cancels the request (generator closed)."""
    job = answer.job
    shape = job.shape
    cid = f"{shape.prefix}-{uuid.uuid4().hex}"
    finished = False
    timer: asyncio.TimerHandle | None = None

    def sse(choices: list, usage: Usage | None = None) -> bytes:
        chunk = shape.chunk(
            id=cid,
            created=int(time.time()),
            model=st.model_id,
            choices=choices,
            system_fingerprint=answer.fingerprint,
            usage=usage,
        )
        return _sse(chunk)

    try:
        # chat: each choice's role first; completions: an echoed prompt (not scored: a scored
        # one goes out with its log-probabilities after its prefill, the engine's Prompt event).
        # They go out with the first event, whose weights every chunk names (a request held back
        # by a live update runs on the weights after it).
        openings = [shape.opening(answer, i) for i in range(len(answer.choices))]
        opening = [o for o in openings if o is not None]
        # the deadline as one timer for the whole stream (a timeout around each step's wait
        # cost ~10% of a streamed token's CPU)
        timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), follow.expire
        )
        while True:
            if not follow.due.is_set():
                if not answer.left:
                    break
                if not follow.expired:
                    await follow.due.wait()
            if follow.expired and follow.failure is None and not follow.changed:  # 504
                info["cancelled"] = "timed out"
                st.engine.cancel(answer.rid)
                yield _sse(error_doc(504, _TIMED_OUT.format(what="the stream")))
                finished = True
                return
            if follow.failure is not None:
                if not isinstance(follow.failure, ApiError):
                    raise follow.failure
                yield _sse(error_doc(follow.failure.status, follow.failure.message))
                finished = True
                return
            out = []
            if opening:
                out.append(b"".join(sse([o]) for o in opening))
                opening = []
            for i in follow.take():
                c = answer.choices[i]
                if c.error is not None:
                    out.append(_sse(error_doc(500, f"choice {i}: {c.error}")))
                    continue
                if c.prompt is not None and not answer.prompt_sent[i]:
                    answer.prompt_sent[i] = True
                    lp = shape.logprobs(answer, i, prompt=True, tokens=False)
                    text = job.prompts[answer.prompt_index(i)]
                    out.append(sse([shape.piece(answer, i, text, None, lp)]))
                text = answer.delta(i)
                if text is None:
                    continue
                lp = None
                if len(c.tokens) > answer.lp_sent[i]:
                    lp = shape.logprobs(answer, i, answer.lp_sent[i])
                    answer.lp_sent[i] = len(c.tokens)
                if c.reason is not None or text or lp:
                    out.append(sse([shape.piece(answer, i, text, c.reason, lp)]))
            if out:
                yield b"".join(out)  # one write for what this step changed
        tail = sse([], usage=answer.usage()) if job.include_usage else b""
        yield tail + b"data: [DONE]\n\n"
        finished = True
    finally:
        if timer is not None:
            timer.cancel()
        if not finished:  # the client went away (the generator was closed): free the lanes
            info["cancelled"] = "client gone"
            log.info("request %d: client went away mid-stream; cancelling it", answer.rid)
            st.engine.cancel(answer.rid)
        _finish(st, answer, info)


def _sse(answer: BaseModel) -> bytes:
    """One server-sent event: the model as compact JSON (pydantic's Rust serializer)."""
    return b"data: " + answer.model_dump_json().encode() + b"\n\n"
