"""The API server's HTTP side: OpenAI's completions API on FastAPI, in front of the engine channel.

Routes: POST /v1/completions (`stream` as server-sent events), GET /v1/models, GET /health,
GET /metrics (Prometheus). Every request body is read under the `serve` limits (bytes actually
read, chunked bodies included; a body deadline), parsed as JSON under a depth and a number-size
limit, validated with pydantic models mirroring OpenAI's request, tokenized here, and submitted
to stage 0 (`EngineClient`). A bad request gets a 4xx OpenAI-style error naming the field.

The process around this (job supervision, uvicorn, signals) is `distlm.inference.supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import asdict, dataclass, field

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from distlm.inference.prompts import RequestError, check_prompt_ids, encode_prompt
from distlm.inference.sampling import make_params
from distlm.log import get_logger

log = get_logger(__name__)
access = get_logger("distlm.inference.access")

OPENAI_DEFAULT_MAX_TOKENS = 16
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
# fields OpenAI defines that this server refuses unless neutral: field -> neutral values
_REFUSED = {
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
}


class ApiError(Exception):
    """An HTTP error answer: status, message naming the field, OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self, *, close: bool = False) -> JSONResponse:
        headers = dict(self.headers)
        if close:  # the body was not read to its end: the connection cannot be reused
            headers["Connection"] = "close"
        return JSONResponse(
            error_doc(self.status, self.message, self.param, self.code),
            status_code=self.status,
            headers=headers,
        )


def error_doc(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


# ----------------------------------------------------------------------------- request models


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's completions request (plus vLLM's `top_k`); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    # text, texts, token ids (one prompt) or lists of token ids (several), as OpenAI and vLLM
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = None
    seed: int | None = None
    user: str | None = Field(None, max_length=256)
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """Each prompt: a string, or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(t, int) for t in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")


_PROMPT_SHAPES = (
    "prompt: expected a string, a non-empty list of strings, a list of token ids (integers) or a "
    "list of lists of token ids"
)


def _check_prompt_shape(prompt) -> None:
    """A clear 400 for a prompt of none of the four shapes (pydantic's union error names only
    the first branch it tried)."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(f"{_PROMPT_SHAPES}, got {_short(prompt)}", param="prompt")
    ints = [isinstance(x, int) and not isinstance(x, bool) for x in prompt]
    if all(ints) or all(isinstance(x, str) for x in prompt):
        return
    if any(ints):
        raise RequestError(
            f"{_PROMPT_SHAPES}: a list of token ids holds integers only, got {_short(prompt)}",
            param="prompt",
        )
    for i, x in enumerate(prompt):
        if not isinstance(x, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        ):
            raise RequestError(
                f"prompt[{i}]: {_PROMPT_SHAPES[8:]}; a list of prompts holds strings only or "
                f"lists of integers only, got {_short(x)}",
                param="prompt",
            )


def _validation_error(e: ValidationError) -> RequestError:
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"] if not _UNION_TAG.match(str(x))]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "request body"
    if err["type"] == "missing":
        return RequestError(f"{where}: required", param=param)
    if err["type"] == "extra_forbidden":
        return RequestError(
            f"{where}: unknown field (OpenAI's completions fields only)", param=param
        )
    return RequestError(
        f"{where}: {err['msg'].lower()}, got {_short(err.get('input'))}", param=param
    )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------- bodies and JSON


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (strings skipped), without parsing."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRING.sub(b'""', raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(raw: bytes, *, max_depth: int, max_digits: int):
    """A request body as JSON under a nesting and a number-size limit; else RequestError (400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 ({e})") from None
    if not text.strip():
        raise RequestError("request body is empty: expected a JSON object")
    depth = json_depth(raw)
    if depth > max_depth:
        raise RequestError(
            f"request body: JSON nested {depth} deep, at most {max_depth} (serve.max_json_depth)"
        )

    def number(s: str, kind):
        if len(s.lstrip("-")) > max_digits:
            raise RequestError(
                f"request body: a number of {len(s)} characters, at most "
                f"{max_digits} (serve.max_number_digits)"
            )
        value = kind(s)
        if kind is float and value in (float("inf"), float("-inf")):
            raise RequestError(f"request body: the number {s} is out of range")
        return value

    def constant(s: str):
        raise RequestError(f"request body is not valid JSON ({s} is not a JSON number)")

    try:
        return json.loads(
            text,
            parse_int=lambda s: number(s, int),
            parse_float=lambda s: number(s, float),
            parse_constant=constant,
        )
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON ({e})") from None
    except RecursionError:  # deeper than the depth scan saw: never expected, still a 400
        raise RequestError("request body: JSON nested too deep") from None


async def read_body(request: Request, *, limit: int, timeout_s: float) -> bytes:
    """The body, counting bytes actually read (chunked too): 413 over `limit`, 408 too slow."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(
            413,
            f"request body of {int(length)} bytes is over the limit of {limit} "
            "(serve.max_request_bytes)",
        )
    chunks, n = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise ApiError(
                        413,
                        f"request body over the limit of {limit} bytes (serve.max_request_bytes)",
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout_s:g} s (serve.body_timeout_s)"
        ) from None
    return b"".join(chunks)


# ----------------------------------------------------------------------------- metrics


class Metrics:
    """The Prometheus series of one API server (its own registry)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter(
            "distlm_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "distlm_time_to_first_token_seconds",
            "Completion requests: time to the first token",
            buckets=latency,
            registry=r,
        )
        self.itl = Histogram(
            "distlm_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=latency,
            registry=r,
        )
        self.e2e = Histogram(
            "distlm_e2e_request_latency_seconds",
            "Completion requests: time from arrival to the last token",
            buckets=latency,
            registry=r,
        )
        self.tokens = Counter("distlm_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("distlm_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.sequences = Counter(
            "distlm_sequences", "Sequences ended, by finish reason", ["reason"], registry=r
        )
        self.queue = Gauge("distlm_queue_depth", "Sequences waiting for a lane", registry=r)
        self.lanes = Gauge("distlm_lanes_busy", "Pipeline lanes holding a sequence", registry=r)
        self.open = Gauge(
            "distlm_sequences_open", "Sequences submitted and not yet ended", registry=r
        )
        self.up = Gauge("distlm_engine_up", "1 while the pipeline answers", registry=r)
        self.compute = Gauge(
            "distlm_stage_compute_seconds", "Forward-pass seconds per stage", ["stage"], registry=r
        )
        self.wait = Gauge(
            "distlm_stage_wait_seconds",
            "Seconds a stage waited for its previous stage",
            ["stage"],
            registry=r,
        )

    def health(self, h: Health) -> None:
        self.queue.set(h.waiting)
        self.lanes.set(h.lanes_busy)
        for st in h.stages:
            self.compute.labels(str(st["stage"])).set(st["compute_s"])
            self.wait.labels(str(st["stage"])).set(st["recv_wait_s"])


# ----------------------------------------------------------------------------- engine client


@dataclass
class Choice:
    """What the API server knows of one sequence while it runs."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list | None] = field(default_factory=list)
    prompt: Prompt | None = None  # the prompt's log-probabilities (echo with logprobs)
    reason: str | None = None
    error: str | None = None
    t_last: float = 0.0


class EngineClient:
    """The API server's end of the engine channel: it binds, stage 0 connects.

    A reader task dispatches Token / Finish / Error to the request they belong to; Health updates
    the gauges. `fail()` ends every open request with a 503 and refuses new ones.
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
        self.queues: dict[int, asyncio.Queue] = {}
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
            q = self.queues.get(msg.rid)
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

    def submit(self, prompts: list[list[int]], n: int, params: dict) -> tuple[int, asyncio.Queue]:
        self._rid += 1
        rid = self._rid
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        self.open_seqs[rid] = len(prompts) * n
        self.metrics.open.set(self.outstanding)
        self._send(Submit(rid=rid, prompts=prompts, n=n, params=params))
        return rid, q

    def cancel(self, rid: int, index: int | None = None) -> None:
        if self.failed is None and rid in self.open_seqs:
            self._send(Cancel(rid=rid, index=index))

    def forget(self, rid: int) -> None:
        self.queues.pop(rid, None)

    def shutdown(self, reason: str) -> None:
        self._send(Shutdown(reason=reason))


# ----------------------------------------------------------------------------- the app


@dataclass
class ServeState:
    """What the routes need: settings, the tokenizer, the engine client, the metrics."""

    scfg: dict
    icfg: dict
    model_id: str
    tokenizer: object
    engine: EngineClient
    metrics: Metrics
    token: str | None = None
    state: str = "starting"  # starting -> ready -> stopping | failed

    def unavailable(self) -> str | None:
        """Why requests get a 503 now, or None when the pipeline serves."""
        if self.engine.failed is not None:
            return self.engine.failed
        if self.state == "starting":
            return "the pipeline is starting"
        if self.state == "stopping":
            return "the server is shutting down"
        return None


def _authorized(st: ServeState, request: Request) -> bool:
    if not st.token:
        return True
    got = request.headers.get("authorization", "")
    return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), st.token.encode())


def _need_auth(st: ServeState, request: Request) -> None:
    if not _authorized(st, request):
        raise ApiError(
            401,
            "missing or wrong bearer token (Authorization: Bearer ...)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def build_app(st: ServeState) -> FastAPI:
    app = FastAPI(title="distlm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response(close=e.status in (408, 413))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = {
            404: f"no route {escape(request.url.path)}",
            405: f"method {request.method} not allowed on {escape(request.url.path)}",
        }
        return JSONResponse(
            error_doc(e.status_code, message.get(e.status_code, str(e.detail))),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.get("/health")
    async def health(request: Request):
        why = st.unavailable()
        if why is not None:
            status = {"starting": "starting", "stopping": "stopping"}.get(st.state, "unavailable")
            return JSONResponse({"status": status, "error": why}, status_code=503)
        doc = {"status": "ok", "model": st.model_id}
        if _authorized(st, request):  # hosts and pids only with the token
            r, h = st.engine.ready, st.engine.health
            doc.update(
                stages=r.stages,
                lanes=r.lanes,
                pipeline=r.pipeline,
                active=h.active if h else 0,
                waiting=h.waiting if h else 0,
                lanes_busy=h.lanes_busy if h else 0,
                open=st.engine.outstanding,
            )
        return doc

    @app.get("/v1/models")
    async def models(request: Request):
        _need_auth(st, request)
        return {
            "object": "list",
            "data": [{"id": st.model_id, "object": "model", "created": 0, "owned_by": "distlm"}],
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        _need_auth(st, request)
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        _need_auth(st, request)
        why = st.unavailable()
        if why is not None:
            raise ApiError(503, f"the pipeline is unavailable: {why}")
        raw = await read_body(
            request, limit=st.scfg["max_request_bytes"], timeout_s=st.scfg["body_timeout_s"]
        )
        try:
            job = _prepare(st, raw)
        except RequestError as e:
            raise ApiError(e.status, str(e), param=e.param) from None
        return await _run(st, request, job)

    return app


@dataclass
class Job:
    """A validated request, tokenized: what goes to the engine and what shapes the answer."""

    req: CompletionRequest
    prompts: list[str]
    ids: list[list[int]]
    truncated: list[int]
    params: dict
    stops: list[str]


def _prepare(st: ServeState, raw: bytes) -> Job:
    scfg, icfg, ready = st.scfg, st.icfg, st.engine.ready
    body = parse_json(raw, max_depth=scfg["max_json_depth"], max_digits=scfg["max_number_digits"])
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object")
    for k, neutral in _REFUSED.items():
        if body.get(k) not in neutral:
            raise RequestError(f"{k}: {_short(body[k])} is not supported by this server", param=k)
    if "prompt" in body:
        _check_prompt_shape(body["prompt"])
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    prompts = req.prompts()
    if req.n < 1:
        raise RequestError(f"n: must be at least 1, got {req.n}", param="n")
    sequences = len(prompts) * req.n
    most = icfg["lanes"] + scfg["max_queued_sequences"]
    if sequences > most:
        raise RequestError(
            f"n: {len(prompts)} prompts x n = {req.n} is {sequences} sequences, at most {most} "
            "(inference.lanes + serve.max_queued_sequences)",
            param="n",
        )
    stops = req.stops()
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("stop: at most 4 non-empty strings", param="stop")
    # echo with logprobs: the prompt tokens' log-probabilities too (max_tokens 0: those alone)
    score_prompt = req.echo and req.logprobs is not None

    def opt(value, default):
        return default if value is None else value

    params = make_params(
        max_new_tokens=opt(req.max_tokens, OPENAI_DEFAULT_MAX_TOKENS),
        temperature=opt(req.temperature, icfg["temperature"]),
        top_k=opt(req.top_k, icfg["top_k"]),
        top_p=opt(req.top_p, icfg["top_p"]),
        seed=opt(req.seed, icfg["seed"]),
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if score_prompt else None,
        echo=req.echo,
        context=ready.context,
        vocab_size=ready.vocab_size,
        max_allowed=scfg["max_tokens"],
    )
    # a prompt cut to fit the context would be scored as another text: refuse that instead
    overflow = (
        "a prompt scored with echo and logprobs is never truncated"
        if score_prompt
        else icfg["prompt_overflow"]
    )
    ids, truncated, texts = [], [], []
    for i, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, str):
                got, cut = encode_prompt(
                    st.tokenizer,
                    prompt,
                    context=ready.context,
                    max_new_tokens=params.max_new_tokens,
                    overflow=overflow,
                )
            else:
                got, cut = check_prompt_ids(
                    prompt,
                    vocab_size=ready.vocab_size,
                    context=ready.context,
                    max_new_tokens=params.max_new_tokens,
                    overflow=overflow,
                )
        except RequestError as e:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise RequestError(str(e).replace("prompt:", f"{where}:", 1), param="prompt") from None
        ids.append(got)
        truncated.append(cut)
        texts.append(prompt if isinstance(prompt, str) else st.tokenizer.decode(got))
    return Job(req, texts, ids, truncated, asdict(params), stops)


class _Answer:
    """One request's choices as the engine's events arrive; text, stops and logprobs."""

    def __init__(self, st: ServeState, job: Job, rid: int, t0: float) -> None:
        self.st, self.job, self.rid, self.t0 = st, job, rid, t0
        self.n = job.req.n
        self.choices = [Choice(i) for i in range(len(job.prompts) * self.n)]
        self.texts = ["" for _ in self.choices]
        self.sent = [0 for _ in self.choices]  # characters streamed so far (per choice)
        self.lp_sent = [0 for _ in self.choices]
        self.left = len(self.choices)
        self.t_first: float | None = None
        self.hold = max((len(s) for s in job.stops), default=1) - 1
        # the text is needed as tokens arrive only to find stop strings or to stream it; else it
        # is decoded once, at the end (a decode of the whole text after every token is O(n^2))
        self.live = bool(job.stops) or job.req.stream

    def prompt_index(self, index: int) -> int:
        return index // self.n

    def event(self, msg) -> list[int]:
        """Take one engine event; the choices it changed. Raises ApiError for a pipeline failure."""
        if isinstance(msg, Error) and msg.rid is None:
            raise ApiError(503, f"the pipeline is unavailable: {msg.message}")
        c = self.choices[msg.index]
        now = time.perf_counter()
        m = self.st.metrics
        if isinstance(msg, Prompt):
            c.prompt = msg
        elif isinstance(msg, Token):
            if c.reason is not None:
                return []  # a token after this choice's stop string: already answered
            if self.t_first is None:
                self.t_first = now
                m.ttft.observe(now - self.t0)
            elif c.t_last:
                m.itl.observe(now - c.t_last)
            c.t_last = now
            m.tokens.inc()
            c.tokens.append(msg.token)
            c.logprobs.append(msg.logprob)
            c.top.append(msg.top)
            if self.live:
                self.texts[c.index] = self.st.tokenizer.decode(c.tokens, skip_special_tokens=True)
                self._stop_strings(c)
                if c.reason is not None:
                    self.st.engine.cancel(self.rid, c.index)
        elif isinstance(msg, Finish):
            if c.reason is None:
                c.reason = "stop" if msg.reason == "stop" else msg.reason
                self.left -= 1
        elif isinstance(msg, Error) and c.reason is None:
            c.reason, c.error = "error", msg.message
            self.left -= 1
        return [c.index]

    def text(self, index: int) -> str:
        """The choice's whole text (after its end)."""
        if not self.live:
            c = self.choices[index]
            return self.st.tokenizer.decode(c.tokens, skip_special_tokens=True)
        return self.texts[index]

    def _stop_strings(self, c: Choice) -> None:
        text = self.texts[c.index]
        for s in self.job.stops:
            at = text.find(s, max(0, self.sent[c.index] - len(s)))
            if at >= 0:
                self.texts[c.index] = text[:at]
                c.reason = "stop"
                self.left -= 1
                return

    def delta(self, index: int) -> str | None:
        """New text of a choice that can go out now (a possible stop-string start held back)."""
        c = self.choices[index]
        text = self.texts[index]
        end = len(text) if c.reason is not None else len(text) - self.hold
        if c.reason is None and text.endswith("\ufffd"):
            return None  # a multi-byte character is not complete yet
        if end <= self.sent[index]:
            return None if c.reason is None else ""
        out = text[self.sent[index] : end]
        self.sent[index] = end
        return out

    def logprobs(self, index: int, since: int = 0, *, prompt: bool = False) -> dict | None:
        """OpenAI's logprobs object for the tokens from `since` on; `prompt`: the echoed prompt's
        tokens first (the first one's log-probability and alternatives null, as OpenAI and vLLM
        give them). text_offset: each token's offset in the choice's text."""
        if self.job.req.logprobs is None:
            return None
        c = self.choices[index]
        tok = self.st.tokenizer
        ids, lps, tops = c.tokens[since:], c.logprobs[since:], c.top[since:]
        offset = 0
        if prompt and c.prompt is not None:
            ids = self.job.ids[self.prompt_index(index)] + ids
            lps, tops = c.prompt.logprobs + lps, c.prompt.top + tops
        elif self.job.req.echo:  # later tokens follow the echoed prompt in the text
            offset = len(self.job.prompts[self.prompt_index(index)])
        if since:
            offset += len(tok.decode(c.tokens[:since]))
        words = [tok.decode([t]) for t in ids]
        offsets = []
        for w in words:
            offsets.append(offset)
            offset += len(w)
        return {
            "tokens": words,
            "token_logprobs": lps,
            "top_logprobs": [
                None if top is None else {tok.decode([int(t)]): lp for t, lp in top} for top in tops
            ],
            "text_offset": offsets,
        }

    def usage(self) -> dict:
        p = sum(len(i) for i in self.job.ids)
        c = sum(len(ch.tokens) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _run(st: ServeState, request: Request, job: Job):
    engine, scfg = st.engine, st.scfg
    sequences = len(job.ids) * job.req.n
    room = st.icfg["lanes"] + scfg["max_queued_sequences"] - engine.outstanding
    if sequences > room:
        raise ApiError(
            429,
            f"the queue is full ({engine.outstanding} sequences open, at most "
            f"{st.icfg['lanes'] + scfg['max_queued_sequences']}: inference.lanes + "
            "serve.max_queued_sequences); retry later",
            headers={"Retry-After": "1"},
        )
    t0 = time.perf_counter()
    st.metrics.prompt_tokens.inc(sum(len(i) for i in job.ids))
    rid, queue = engine.submit(job.ids, job.req.n, job.params)
    answer = _Answer(st, job, rid, t0)
    info = request.scope.setdefault("distlm", {})
    info["rid"] = rid
    deadline = time.monotonic() + scfg["request_timeout_s"]
    if job.req.stream:
        return StreamingResponse(
            _stream(st, answer, queue, deadline, info),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _complete(st, request, answer, queue, deadline, info)


async def _next(queue: asyncio.Queue, deadline: float, what: str):
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, left)):
            return await queue.get()
    except TimeoutError:
        raise ApiError(
            504, f"{what} not done within the request timeout (serve.request_timeout_s)"
        ) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: the next message is a disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _finish(st: ServeState, answer: _Answer, info: dict) -> None:
    st.engine.forget(answer.rid)
    info["tokens"] = sum(len(c.tokens) for c in answer.choices)
    if answer.t_first is not None:
        info["ttft_s"] = answer.t_first - answer.t0
    st.metrics.e2e.observe(time.perf_counter() - answer.t0)


_GONE = object()  # on a request's queue: its client went away


async def _complete(st: ServeState, request: Request, answer: _Answer, queue, deadline, info):
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda f: f.cancelled() or queue.put_nowait(_GONE))
    try:
        while answer.left:
            msg = (
                queue.get_nowait()
                if not queue.empty()
                else await _next(queue, deadline, "the completion")
            )
            if msg is _GONE:
                st.engine.cancel(answer.rid)
                info["cancelled"] = "client gone"
                return Response(status_code=499)  # nobody reads it; the access log does
            answer.event(msg)
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
    job = answer.job
    out = _base(st, f"cmpl-{uuid.uuid4().hex}")
    out["choices"] = []
    for c in answer.choices:
        text = answer.text(c.index)
        if job.req.echo:
            text = job.prompts[answer.prompt_index(c.index)] + text
        out["choices"].append(
            {
                "text": text,
                "index": c.index,
                "logprobs": answer.logprobs(c.index, prompt=job.req.echo),
                "finish_reason": c.reason,
                "prompt_truncated_tokens": job.truncated[answer.prompt_index(c.index)],
            }
        )
    out["usage"] = answer.usage()
    warnings = _warnings(job)
    if warnings:
        out["warnings"] = warnings
    return out


async def _stream(st: ServeState, answer: _Answer, queue, deadline, info):
    """Server-sent events; a client gone mid-stream cancels the request (generator closed)."""
    cid = f"cmpl-{uuid.uuid4().hex}"
    job = answer.job
    finished = False

    def chunk(index: int, text: str, reason: str | None, **extra) -> bytes:
        c = _base(st, cid)
        c["choices"] = [
            {
                "text": text,
                "index": index,
                "finish_reason": reason,
                "logprobs": extra.pop("logprobs", None),
                **extra,
            }
        ]
        return _sse(c)

    # echo with logprobs: a choice's prompt goes out with its log-probabilities, after its prefill
    scored = job.req.echo and job.req.logprobs is not None
    try:
        if job.req.echo and not scored:
            for i in range(len(answer.choices)):
                yield chunk(i, job.prompts[answer.prompt_index(i)], None)
        echoed = [not scored for _ in answer.choices]
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
                if not echoed[i] and c.prompt is not None:
                    echoed[i] = True
                    lp = answer.logprobs(i, prompt=True)
                    yield chunk(i, job.prompts[answer.prompt_index(i)], None, logprobs=lp)
                text = answer.delta(i)
                if text is None:
                    continue
                lp = None
                if len(c.tokens) > answer.lp_sent[i]:
                    lp = answer.logprobs(i, answer.lp_sent[i])
                    answer.lp_sent[i] = len(c.tokens)
                if c.reason is not None:
                    yield chunk(
                        i,
                        text,
                        c.reason,
                        logprobs=lp,
                        prompt_truncated_tokens=job.truncated[answer.prompt_index(i)],
                    )
                elif text or lp:
                    yield chunk(i, text, None, logprobs=lp)
        if job.req.stream_options is not None and job.req.stream_options.include_usage:
            c = _base(st, cid)
            c["choices"] = []
            c["usage"] = answer.usage()
            yield _sse(c)
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (the generator was closed): free the lanes
            info["cancelled"] = "client gone"
            log.info("request %d: client went away mid-stream; cancelling it", answer.rid)
            st.engine.cancel(answer.rid)
        _finish(st, answer, info)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _base(st: ServeState, cid: str) -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": st.model_id,
    }


def _warnings(job: Job) -> list[str]:
    return [
        f"prompt {i}: dropped its first {cut} tokens to fit the context "
        "(inference.prompt_overflow is truncate)"
        for i, cut in enumerate(job.truncated)
        if cut
    ]


# ----------------------------------------------------------------------------- access log


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")


def escape(text: str) -> str:
    """Control characters (and backslashes) as escapes: a request cannot write to the terminal."""
    return _CONTROL.sub(
        lambda m: (
            m.group().encode("unicode_escape").decode("ascii") if m.group() != "\\" else "\\\\"
        ),
        text,
    )


class AccessLog:
    """ASGI middleware: one line per request (client, method, path, status, timings), escaped;
    and the requests-by-status counter."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        info = scope.setdefault("distlm", {})
        status = {"code": 0}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            code = status["code"] or 499
            path = scope.get("path", "")
            route = (
                path
                if path in ("/v1/completions", "/v1/models", "/health", "/metrics")
                else "other"
            )
            self.metrics.requests.labels(route, str(code)).inc()
            client = scope.get("client") or ("-", 0)
            extra = "".join(
                f" {k}={v:.4f}" if isinstance(v, float) else f" {k}={v}" for k, v in info.items()
            )
            access.info(
                "%s:%s %s %s %d %.4fs%s",
                client[0],
                client[1],
                escape(scope.get("method", "")),
                escape(path),
                code,
                time.perf_counter() - t0,
                escape(extra),
            )
