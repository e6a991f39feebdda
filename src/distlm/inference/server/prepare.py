"""A completions request made ready for the engine: its body checked as OpenAI's request, then
the one request path (validate.prepare_request) tokenizes its prompts and checks its sampling.

A request without `max_tokens` gets `inference.max_new_tokens` (OpenAI's own default is 16; the
serve stage declares the key, so the key decides)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from distlm.inference.messages import Ready
from distlm.inference.prompts import RequestError
from distlm.inference.sampling import SamplingParams
from distlm.inference.server.errors import ApiError
from distlm.inference.server.requests import (
    _REFUSED,
    CompletionRequest,
    _check_prompt_shape,
    _short,
    _validation_error,
    parse_json,
)
from distlm.inference.validate import HTTP_NAMES, prepare_request, sampling_settings
from distlm.settings import EngineSettings, ServeSettings


@dataclass
class Job:
    """A validated request, tokenized: what goes to the engine and what shapes the answer."""

    req: CompletionRequest
    prompts: list[str]
    ids: list[list[int]]
    truncated: list[int]
    params: SamplingParams
    stops: list[str]


@dataclass(frozen=True)
class Preparing:
    """What making a request ready needs: the limits (serve), the sampling defaults and prompt
    policy (inference), the tokenizer, and the pipeline's Ready (its context and vocabulary)."""

    serve: ServeSettings
    inference: EngineSettings
    tokenizer: Any  # a transformers tokenizer
    ready: Callable[[], Ready | None]  # the engine's Ready, None while the pipeline starts


def prepare_completion(st: Preparing, raw: bytes) -> Job:
    serve, inference, ready = st.serve, st.inference, st.ready()
    if ready is None:  # the route answers 503 while the pipeline starts; never reached then
        raise ApiError(503, "the pipeline is unavailable: the pipeline is starting")
    body = parse_json(raw, max_depth=serve.max_json_depth, max_digits=serve.max_number_digits)
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
    most = inference.lanes + serve.max_queued_sequences
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
    prompt_only = req.echo and req.max_tokens == 0  # echo: the prompt alone, no new token
    # a prompt cut to fit the context would be scored as another text: refuse that instead
    overflow = (
        "a prompt scored with echo and logprobs is never truncated"
        if score_prompt
        else inference.prompt_overflow
    )
    try:
        # what the request leaves out comes from the inference section (SamplingSettings):
        # a request without max_tokens gets inference.max_new_tokens
        sampling = sampling_settings(
            {
                "max_new_tokens": None if prompt_only else req.max_tokens,
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
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if score_prompt else None,
        )
    except RequestError as e:
        raise http_error(e, prompts=len(prompts)) from None
    return Job(req, got.texts, got.ids, got.truncated, got.params, stops)


def http_error(e: RequestError, *, prompts: int = 1) -> RequestError:
    """A neutral RequestError named as the completions request names its field (a 400's param)."""
    param = HTTP_NAMES.get(e.param, e.param) if e.param else None
    if param is None:
        return e
    where = f"{param}[{e.index}]" if param == "prompt" and prompts > 1 else param
    message = e.named(where)
    if param == "max_tokens" and e.detail.startswith("must be >= 1"):
        message += " (at least 1; 0 only with echo: the prompt alone)"
    return RequestError(message, param=param, status=e.status)
