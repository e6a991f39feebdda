"""A request made ready for the engine, completions or chat alike: its body checked as OpenAI's
request, its prompts made (text or token ids; a chat's messages rendered by the chat template),
then the one request path (request.prepare_request) tokenizes them and checks the sampling.

A request without `max_tokens` gets `inference.max_new_tokens` (OpenAI's own default is 16; the
serve stage declares the key, so the key decides)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from distlm.inference.messages import Ready
from distlm.inference.prompts import RequestError
from distlm.inference.request import prepare_request, sampling_settings
from distlm.inference.sampling_params import SamplingParams
from distlm.inference.server.errors import ApiError
from distlm.inference.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    _validation_error,
    parse_json,
)
from distlm.inference.server.shapes import ChatShape, CompletionShape, Shape
from distlm.settings import EngineSettings, ServeSettings


@dataclass
class Job:
    """A validated request, tokenized: what goes to the engine and what shapes the answer."""

    shape: Shape  # how the answer's choices and chunks look: completions or chat
    prompts: list[str]  # per prompt, its text
    ids: list[list[int]]  # per prompt, its token ids
    truncated: list[int]
    params: SamplingParams
    stops: list[str]
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    echo: bool  # the answer's text starts with the prompt (completions' echo)


@dataclass(frozen=True)
class Preparing:
    """What making a request ready needs: the limits (serve), the sampling defaults and prompt
    policy (inference), the tokenizer, and the pipeline's Ready (its context and vocabulary)."""

    serve: ServeSettings
    inference: EngineSettings
    tokenizer: Any  # a transformers tokenizer
    ready: Callable[[], Ready | None]  # the engine's Ready, None while the pipeline starts


def prepare_completion(st: Preparing, raw: bytes) -> Job:
    """POST /v1/completions's body, ready for the engine."""
    return _prepare(st, raw, CompletionRequest, CompletionShape())


def prepare_chat(st: Preparing, raw: bytes) -> Job:
    """POST /v1/chat/completions's body, ready for the engine."""
    return _prepare(st, raw, ChatCompletionRequest, ChatShape())


def _prepare(st: Preparing, raw: bytes, kind: type[OpenAIRequest], shape: Shape) -> Job:
    """The one request path: both routes differ only in their request model (how the prompt is
    made, what the fields are called) and the shape of their answer."""
    serve, inference, ready = st.serve, st.inference, st.ready()
    if ready is None:  # the route answers 503 while the pipeline starts; never reached then
        raise ApiError(503, "the pipeline is unavailable: the pipeline is starting")
    body = parse_json(raw, max_depth=serve.max_json_depth, max_digits=serve.max_number_digits)
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object")
    kind.check_body(body)
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e, kind.route) from None
    if req.n < 1:
        raise RequestError(f"n: must be at least 1, got {req.n}", param="n")
    stops = req.stops()
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("stop: at most 4 non-empty strings", param="stop")
    prompts = req.prompts(st.tokenizer)
    sequences = len(prompts) * req.n
    most = inference.lanes + serve.max_queued_sequences
    if sequences > most:
        raise RequestError(
            f"n: {len(prompts)} prompts x n = {req.n} is {sequences} sequences, at most {most} "
            "(inference.lanes + serve.max_queued_sequences)",
            param="n",
        )
    echo, alternatives = req.echoes(), req.alternatives()
    # echo with logprobs: the prompt tokens' log-probabilities too (max_tokens 0: those alone)
    score_prompt = echo and alternatives is not None
    prompt_only = echo and req.new_tokens() == 0  # echo: the prompt alone, no new token
    # a prompt cut to fit the context would be scored as another text: refuse that instead
    if score_prompt:
        overflow = "a prompt scored with echo and logprobs is never truncated"
    elif not req.truncates:
        overflow = f"a {req.route} prompt is never truncated"
    else:
        overflow = inference.prompt_overflow
    try:
        # what the request leaves out comes from the inference section (SamplingSettings):
        # a request without max_tokens gets inference.max_new_tokens
        sampling = sampling_settings(
            {
                "max_new_tokens": None if prompt_only else req.new_tokens(),
                "temperature": req.temperature,
                "top_k": req.top_k,
                "top_p": req.top_p,
                "seed": req.seed,
            },
            defaults=inference,
        )
        if prompt_only:
            sampling = sampling.model_copy(update={"max_new_tokens": 0})
        got = prepare_request(
            prompts,
            sampling,
            tokenizer=st.tokenizer,
            context=ready.context,
            overflow=overflow,
            vocab_size=ready.vocab_size,
            max_allowed=serve.max_tokens,
            logprobs=alternatives,
            prompt_logprobs=alternatives if score_prompt else None,
        )
    except RequestError as e:
        raise http_error(e, req, prompts=len(prompts)) from None
    return Job(
        shape,
        got.texts,
        got.ids,
        got.truncated,
        got.params,
        stops,
        n=req.n,
        stream=req.stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        echo=echo,
    )


def http_error(e: RequestError, req: OpenAIRequest, *, prompts: int = 1) -> RequestError:
    """A neutral RequestError named as the request names its field (a 400's param)."""
    param = req.http_name(e.param) if e.param else None
    if param is None:
        return e
    where = f"{param}[{e.index}]" if param == "prompt" and prompts > 1 else param
    message = e.named(where)
    if param == "max_tokens" and e.detail.startswith("must be >= 1"):
        message += req.max_tokens_hint
    return RequestError(message, param=param, status=e.status)
