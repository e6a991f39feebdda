"""Answering a prepared request (completions or chat: the job's shape says how the answer looks):
submitted to the engine, then one JSON answer or a stream of server-sent events; a client gone or
a deadline passed cancels the request's sequences."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from distlm.core.log import get_logger
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
    request deadline, the model's name, the tokenizer and the metrics."""

    engine: EngineClient
    room: int  # sequences open at once: inference.lanes + serve.max_queued_sequences
    request_timeout_s: float  # serve.request_timeout_s
    model_id: str
    tokenizer: Any  # a transformers tokenizer
    metrics: Metrics

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
    st.metrics.prompt_tokens.inc(sum(len(i) for i in job.ids))
    rid = engine.new_rid()
    answer = Answer(job, rid, t0, tokenizer=st.tokenizer, metrics=st.metrics, cancel=engine.cancel)
    info = request.scope.setdefault("distlm", {})
    info["rid"] = rid
    deadline = time.monotonic() + st.request_timeout_s
    if job.stream:
        queue: asyncio.Queue = asyncio.Queue()
        engine.submit(rid, job.ids, job.n, job.params, queue)
        return StreamingResponse(
            _stream(st, answer, queue, deadline, info),
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
        raise ApiError(
            504, f"{what} not done within the request timeout (serve.request_timeout_s)"
        ) from None


async def _next(queue: asyncio.Queue, deadline: float, what: str):
    return await _within(deadline, what, queue.get())


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
    st.metrics.e2e.observe(time.perf_counter() - answer.t0)


_GONE = object()  # on a request's queue: its client went away


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
    )
    return JSONResponse(out.model_dump(mode="json"))


async def _stream(st: Answering, answer: Answer, queue, deadline, info):
    """Server-sent events; a client gone mid-stream cancels the request (generator closed)."""
    job = answer.job
    shape = job.shape
    cid = f"{shape.prefix}-{uuid.uuid4().hex}"
    finished = False

    def sse(choices: list, usage: Usage | None = None) -> bytes:
        chunk = shape.chunk(
            id=cid, created=int(time.time()), model=st.model_id, choices=choices, usage=usage
        )
        return _sse(chunk)

    try:
        for i in range(len(answer.choices)):
            first = shape.opening(answer, i)  # chat: the role; completions: an echoed prompt
            if first is not None:
                yield sse([first])
        # echo with logprobs: a choice's prompt goes out with its log-probabilities, after its
        # prefill (the engine's Prompt event)
        while answer.left:
            try:
                changed = answer.event(await _next(queue, deadline, "the stream"))
            except ApiError as e:
                if e.status == 504:
                    info["cancelled"] = "timed out"
                    st.engine.cancel(answer.rid)
                yield _sse(error_doc(e.status, e.message))
                finished = True
                return
            for i in changed:
                c = answer.choices[i]
                if c.error is not None:
                    yield _sse(error_doc(500, f"choice {i}: {c.error}"))
                    continue
                if c.prompt is not None and not answer.prompt_sent[i]:
                    answer.prompt_sent[i] = True
                    lp = shape.logprobs(answer, i, prompt=True)
                    text = job.prompts[answer.prompt_index(i)]
                    yield sse([shape.piece(answer, i, text, None, lp)])
                text = answer.delta(i)
                if text is None:
                    continue
                lp = None
                if len(c.tokens) > answer.lp_sent[i]:
                    lp = shape.logprobs(answer, i, answer.lp_sent[i])
                    answer.lp_sent[i] = len(c.tokens)
                if c.reason is not None or text or lp:
                    yield sse([shape.piece(answer, i, text, c.reason, lp)])
        if job.include_usage:
            yield sse([], usage=answer.usage())
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (the generator was closed): free the lanes
            info["cancelled"] = "client gone"
            log.info("request %d: client went away mid-stream; cancelling it", answer.rid)
            st.engine.cancel(answer.rid)
        _finish(st, answer, info)


def _sse(answer: BaseModel) -> bytes:
    # json.dumps, as the events were written before the answers were typed: the same bytes
    return f"data: {json.dumps(answer.model_dump(mode='json'))}\n\n".encode()
