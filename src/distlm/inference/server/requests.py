"""The completions request: its body read under limits, parsed under limits, validated.

Every request body is read under the `serve` limits (bytes actually read, chunked bodies included;
a body deadline), parsed as JSON under a depth and a number-size limit, and validated with a
pydantic model mirroring OpenAI's request. Each failure is a RequestError (400) or an ApiError
(408, 413) naming the field or the limit.
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from distlm.inference.prompts import RequestError
from distlm.inference.server.errors import ApiError

# fields OpenAI defines that this server refuses unless neutral: field -> neutral values
_REFUSED = {
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
}


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

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [[t for t in p if isinstance(t, int)]]
        return [x for x in p if isinstance(x, (str, list))]

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
