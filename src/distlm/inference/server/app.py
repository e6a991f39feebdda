"""The API server's HTTP side: OpenAI's completions API on Starlette, in front of the engine channel.

Routes: POST /v1/completions and POST /v1/chat/completions (`stream` as server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus), POST /update_weights_from_disk and
POST /update_weights_from_distributed (new weights, no restart: updates.py). Every POST route
reads its body one way (`body`: the token, the pipeline, the size and time limits). Both
completions routes take one path: the
request is read and validated (requests.py), prepared (prepare.py: its prompt made, tokenized,
its sampling checked; a chat's messages rendered by the chat template, chat.py), submitted to
stage 0 (client.py) and answered (answer.py, render.py, in the route's shape: shapes.py). A bad
request gets a 4xx OpenAI-style error naming the field.

The process around this (uvicorn, the supervisor's word) is `distlm.inference.server.worker`; the
supervisor that starts these processes and the job is `distlm.inference.server.supervisor`.

The routes are Starlette's, FastAPI's base, without FastAPI's layer: every route reads its own
request (no typed parameters to inject), and FastAPI's dependency solving per request cost the
API server 7% of its CPU at 64 clients (benchmarks/inference/profile_serve.py, docs/performance.md).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Literal

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from distlm.inference.prompts import RequestError
from distlm.inference.server.access_log import escape
from distlm.inference.server.answer import run_completion
from distlm.inference.server.errors import ApiError, error_doc, from_request
from distlm.inference.server.metrics import exposition
from distlm.inference.server.prepare import Job, Preparing, prepare_chat, prepare_completion
from distlm.inference.server.requests import read_body
from distlm.inference.server.responses import Health, ModelCard, ModelList
from distlm.inference.server.state import ServeState
from distlm.inference.server.updates import ROUTES, may_update, read_update, run_update


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


def _json(answer: BaseModel, *, status: int = 200) -> JSONResponse:
    return JSONResponse(answer.model_dump(mode="json"), status_code=status)


def build_app(st: ServeState) -> Starlette:
    async def _api_error(request: Request, e: Exception):
        assert isinstance(e, ApiError)
        return e.response(close=e.status in (408, 413))

    async def _http_error(request: Request, e: Exception):
        assert isinstance(e, StarletteHTTPException)
        message = {
            404: f"no route {escape(request.url.path)}",
            405: f"method {request.method} not allowed on {escape(request.url.path)}",
        }
        return JSONResponse(
            error_doc(e.status_code, message.get(e.status_code, str(e.detail))).model_dump(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    async def health(request: Request):
        why = st.unavailable()
        if why is not None:
            status: Literal["starting", "stopping", "unavailable"] = "unavailable"
            if st.state == "starting" or st.state == "stopping":
                status = st.state
            return _json(Health(status=status, error=why), status=503)
        doc = Health(status="ok", model=st.model_id)
        r, h = st.engine.ready, st.engine.health
        if r is not None and _authorized(st, request):  # hosts and pids only with the token
            doc = doc.model_copy(
                update={
                    "stages": r.stages,
                    "lanes": r.lanes,
                    "pipeline": r.pipeline,
                    "active": h.active if h else 0,
                    "waiting": h.waiting if h else 0,
                    "lanes_busy": h.lanes_busy if h else 0,
                    "open": st.engine.outstanding,
                    "weights": r.weights,
                    "system_fingerprint": r.fingerprint,
                    "last_update": r.last_update,
                }
            )
        return _json(doc)

    async def models(request: Request):
        _need_auth(st, request)
        return _json(ModelList(data=[ModelCard(id=st.model_id)]))

    async def metrics(request: Request):
        _need_auth(st, request)
        st.metrics.flush()
        return Response(exposition(), media_type=CONTENT_TYPE_LATEST)

    async def body(request: Request) -> bytes:
        """A POST route's body, once the token is checked and the pipeline is up."""
        _need_auth(st, request)
        why = st.unavailable()
        if why is not None:
            raise ApiError(503, f"the pipeline is unavailable: {why}")
        return await read_body(
            request, limit=st.serve.max_request_bytes, timeout_s=st.serve.body_timeout_s
        )

    async def answer(request: Request, prepare: Callable[[Preparing, bytes], Job]):
        """The one request path of both completions routes; `prepare` makes the route's job."""
        raw = await body(request)
        try:
            job = prepare(st.preparing, raw)
        except RequestError as e:
            raise from_request(e) from None
        return await run_completion(st.answering, request, job)

    def update_route(route: str):
        """An update route (updates.ROUTES): its body is the route's request."""

        async def update_weights(request: Request):
            _need_auth(st, request)
            may_update(st)
            raw = await body(request)
            try:
                req = read_update(st, raw, route)
            except RequestError as e:
                raise from_request(e) from None
            answer, status = await run_update(st, req)
            return _json(answer, status=status)

        return update_weights

    async def completions(request: Request):
        return await answer(request, prepare_completion)

    async def chat_completions(request: Request):
        return await answer(request, prepare_chat)

    get, post = ["GET"], ["POST"]
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=post),
            Route("/v1/chat/completions", chat_completions, methods=post),
            Route("/v1/models", models, methods=get),
            Route("/health", health, methods=get),
            Route("/metrics", metrics, methods=get),
            *(Route(route, update_route(route), methods=post) for route in ROUTES),
        ],
        exception_handlers={ApiError: _api_error, StarletteHTTPException: _http_error},
    )
