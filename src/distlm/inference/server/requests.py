"""The requests: their bodies read under limits, parsed under limits, validated.

Every request body is read under the `serve` limits (bytes actually read, chunked bodies included;
a body deadline), parsed as JSON under a depth and a number-size limit, and validated with a
pydantic model mirroring OpenAI's request: completions (`CompletionRequest`) or chat completions
(`ChatCompletionRequest`), which share their sampling fields (`OpenAIRequest`). Each failure is a
RequestError (400) or an ApiError (408, 413) naming the field or the limit.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from distlm.inference.prompts import RequestError
from distlm.inference.request import HTTP_NAMES
from distlm.inference.sampling_params import MAX_LOGPROBS
from distlm.inference.server.chat import chat_prompt, check_messages
from distlm.inference.server.errors import ApiError, short

# fields OpenAI defines that this server refuses unless neutral: field -> neutral values
_REFUSED_BOTH = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """What OpenAI's completions and chat completions requests share (plus vLLM's `top_k`): the
    sampling fields, `n`, `stop`, `stream`. Unknown fields are refused. Each route's request says
    how its prompts are made (`prompts`), which log-probabilities it asks for (`alternatives`)
    and what its fields are called (`http_name`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    route: ClassVar[str]  # the route's name in messages: "completions", "chat completions"
    refused: ClassVar[dict[str, tuple]]  # fields refused unless neutral: field -> neutral values
    truncates: ClassVar[bool] = True  # a prompt too long may be cut (inference.prompt_overflow)
    max_tokens_hint: ClassVar[str] = ""  # after "max_tokens: must be >= 1"

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @classmethod
    def check_body(cls, body: dict) -> None:
        """Before validation: refused fields, and the shapes pydantic's union errors name poorly."""
        for k, neutral in cls.refused.items():
            if body.get(k) not in neutral:
                raise RequestError(
                    f"{k}: {short(body[k])} is not supported by this server", param=k
                )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int | None:
        """The new tokens asked for (None: the default, inference.max_new_tokens)."""
        return self.max_tokens

    def echoes(self) -> bool:
        """Whether the answer's text starts with the prompt."""
        return False

    def alternatives(self) -> int | None:
        """Log-probabilities asked for: None, or the alternatives per token (0..20)."""
        raise NotImplementedError

    def prompts(self, tokenizer) -> list[str | list[int]]:
        """Each prompt: a string, or a list of token ids."""
        raise NotImplementedError

    def http_name(self, neutral: str) -> str:
        """The request's field that sets a neutral field (request.HTTP_NAMES's, by default)."""
        return HTTP_NAMES.get(neutral, neutral)


class CompletionRequest(OpenAIRequest):
    """OpenAI's completions request (plus vLLM's `top_k`); unknown fields are refused."""

    route: ClassVar[str] = "completions"
    refused: ClassVar[dict[str, tuple]] = {
        "suffix": (None, ""),
        **_REFUSED_BOTH,
        "best_of": (None, 1),
    }
    max_tokens_hint: ClassVar[str] = " (at least 1; 0 only with echo: the prompt alone)"

    # text, texts, token ids (one prompt) or lists of token ids (several), as OpenAI and vLLM
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @classmethod
    def check_body(cls, body: dict) -> None:
        super().check_body(body)
        if "prompt" in body:
            _check_prompt_shape(body["prompt"])

    def echoes(self) -> bool:
        return self.echo

    def alternatives(self) -> int | None:
        return self.logprobs

    def prompts(self, tokenizer=None) -> list[str | list[int]]:
        """Each prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [[t for t in p if isinstance(t, int)]]
        return [x for x in p if isinstance(x, (str, list))]


class TextPart(BaseModel):
    """A part of a message's content: text (the only kind this server takes)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


ROLES = ("system", "user", "assistant")


class ChatMessage(BaseModel):
    """One message of a conversation, as OpenAI's chat request has it (text only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=256)

    def for_template(self) -> dict[str, str]:
        """The message as a chat template takes it: content parts joined by newlines (as vLLM
        gives them to a template that renders content as a string)."""
        content = self.content
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(OpenAIRequest):
    """OpenAI's chat completions request, text only (plus vLLM's `top_k`): `messages` rendered by
    the model folder's chat template; `logprobs` (bool) and `top_logprobs` (0..20);
    `max_completion_tokens` as OpenAI's newer name of `max_tokens`."""

    route: ClassVar[str] = "chat completions"
    refused: ClassVar[dict[str, tuple]] = {
        **_REFUSED_BOTH,
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "functions": (None, []),
        "function_call": (None, "none"),
        "response_format": (None, {"type": "text"}),
    }
    truncates: ClassVar[bool] = False  # a cut conversation is another conversation

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | None = None
    functions: list | None = None
    function_call: str | None = None
    response_format: dict | None = None

    @classmethod
    def check_body(cls, body: dict) -> None:
        super().check_body(body)
        if "messages" in body:
            check_messages(body["messages"])
        both = body.get("max_tokens"), body.get("max_completion_tokens")
        if None not in both and both[0] != both[1]:
            raise RequestError(
                f"max_completion_tokens: {short(both[1])} and max_tokens: {short(both[0])} "
                "differ; give one of them (max_tokens is its older name)",
                param="max_completion_tokens",
            )
        top = body.get("top_logprobs")
        if top is not None and body.get("logprobs") is not True:
            raise RequestError(
                "top_logprobs: needs logprobs: true (as OpenAI's API)", param="top_logprobs"
            )
        if isinstance(top, int) and not isinstance(top, bool) and not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(
                f"top_logprobs: must be in 0..{MAX_LOGPROBS}, got {top}", param="top_logprobs"
            )

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompts(self, tokenizer) -> list[str | list[int]]:
        """The conversation rendered by the folder's chat template: one prompt of token ids."""
        return [chat_prompt(tokenizer, [m.for_template() for m in self.messages])]

    def http_name(self, neutral: str) -> str:
        if neutral == "max_new_tokens":
            return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"
        return {"prompt": "messages", "logprobs": "top_logprobs"}.get(neutral, neutral)


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
        raise RequestError(f"{_PROMPT_SHAPES}, got {short(prompt)}", param="prompt")
    ints = [isinstance(x, int) and not isinstance(x, bool) for x in prompt]
    if all(ints) or all(isinstance(x, str) for x in prompt):
        return
    if any(ints):
        raise RequestError(
            f"{_PROMPT_SHAPES}: a list of token ids holds integers only, got {short(prompt)}",
            param="prompt",
        )
    for i, x in enumerate(prompt):
        if not isinstance(x, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        ):
            raise RequestError(
                f"prompt[{i}]: {_PROMPT_SHAPES[8:]}; a list of prompts holds strings only or "
                f"lists of integers only, got {short(x)}",
                param="prompt",
            )


def field_path(loc) -> str:
    """A field's path as a request names it: `messages[2].role`."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _validation_error(e: ValidationError, route: str) -> RequestError:
    """The first of a body's errors, naming its field; `route`: whose fields the body may have
    (an OpenAI route's name, or distlm's own route's path)."""
    err = e.errors()[0]
    loc = [x for x in err["loc"] if not _UNION_TAG.match(str(x))]
    param = str(loc[0]) if loc else None
    where = field_path(loc) if loc else "request body"
    if err["type"] == "missing":
        return RequestError(f"{where}: required", param=param)
    if err["type"] == "extra_forbidden":
        whose = f"{route}'s" if route.startswith("/") else f"OpenAI's {route}"
        return RequestError(f"{where}: unknown field ({whose} fields only)", param=param)
    return RequestError(
        f"{where}: {err['msg'].lower()}, got {short(err.get('input'))}", param=param
    )


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
    # a body nested d deep has d opening brackets at least: most have fewer than the limit, and
    # need no scan (counting bytes is C's work; the scan is Python's, ~5 us a request)
    if raw.count(b"[") + raw.count(b"{") > max_depth:
        depth = json_depth(raw)
        if depth > max_depth:
            raise RequestError(
                f"request body: JSON nested {depth} deep, at most {max_depth} "
                "(serve.max_json_depth)"
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
