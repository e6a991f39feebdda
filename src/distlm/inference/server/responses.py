"""The API server's answers as typed models: OpenAI's completion and chat completion, their
stream chunks, the models list and error body, and /health. Routes build these, never dict literals; a field that OpenAI
leaves out when it has nothing to say is left out here too (`_absent_when_none`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from distlm.inference.messages import UpdateRecord
from distlm.inference.stats import StageInfo


def _absent_when_none(description: str):
    """A field that is left out of the JSON when None (instead of null)."""
    return Field(None, description=description, exclude_if=lambda v: v is None)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Answer):
    message: str = Field(description="what is wrong, naming the field or the limit")
    type: str = Field(description="OpenAI's error type for the status")
    param: str | None = Field(None, description="the request field at fault")
    code: str | None = Field(None, description="a machine-readable code (invalid_api_key)")


class ErrorBody(_Answer):
    error: ErrorDetail


class Logprobs(_Answer):
    """OpenAI's logprobs object for a choice's tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Answer):
    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: str | None
    prompt_truncated_tokens: int = Field(
        description="leading prompt tokens dropped to fit the context (distlm's addition)"
    )


class Completion(_Answer):
    """The answer to a completions request (stream false)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str = Field(
        description="the weights that produced it: `fp_` and the start of their sha256"
    )
    warnings: list[str] | None = _absent_when_none("prompts cut to fit the context")


class ChunkChoice(_Answer):
    text: str
    index: int
    finish_reason: str | None
    logprobs: Logprobs | None = None
    prompt_truncated_tokens: int | None = _absent_when_none("on a choice's last chunk")


class CompletionChunk(_Answer):
    """One server-sent event of a streamed completion; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str = Field(
        description="the weights that produced it: `fp_` and the start of their sha256"
    )
    usage: Usage | None = _absent_when_none("the last chunk, with stream_options.include_usage")


class ChatTopLogprob(_Answer):
    """One of the most likely tokens at a position (OpenAI's chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")


class ChatTokenLogprob(_Answer):
    """A chosen token, its log-probability and the `top_logprobs` most likely tokens."""

    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes")
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Answer):
    """OpenAI's logprobs object of a chat choice: one entry per token."""

    content: list[ChatTokenLogprob] | None


class AssistantMessage(_Answer):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Answer):
    """The answer to a chat completions request (stream false)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str = Field(
        description="the weights that produced it: `fp_` and the start of their sha256"
    )


class ChatDelta(_Answer):
    """What a chunk adds to a chat choice: the role first, then content."""

    role: Literal["assistant"] | None = _absent_when_none("in a choice's first chunk")
    content: str | None = _absent_when_none("new text")


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Answer):
    """One server-sent event of a streamed chat completion; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str = Field(
        description="the weights that produced it: `fp_` and the start of their sha256"
    )
    usage: Usage | None = _absent_when_none("the last chunk, with stream_options.include_usage")


class ModelCard(_Answer):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "distlm"


class ModelList(_Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(_Answer):
    """GET /health: the status always; the pipeline's details only with the bearer token."""

    status: Literal["ok", "starting", "stopping", "unavailable"]
    model: str | None = _absent_when_none("the served model's name")
    error: str | None = _absent_when_none("why the server answers 503")
    stages: int | None = _absent_when_none("pipeline stages")
    lanes: int | None = _absent_when_none("inference.lanes")
    pipeline: list[StageInfo] | None = _absent_when_none("where each stage runs")
    active: int | None = _absent_when_none("sequences in lanes")
    waiting: int | None = _absent_when_none("sequences waiting for a lane")
    lanes_busy: int | None = _absent_when_none("lanes holding a sequence")
    open: int | None = _absent_when_none("sequences submitted and not yet ended")
    weights: str | None = _absent_when_none("the served weights' digest (their file's sha256)")
    system_fingerprint: str | None = _absent_when_none("what every answer names the weights by")
    last_update: UpdateRecord | None = _absent_when_none(
        "the last update that switched the weights: source, kind, weights, seconds, bytes, at, "
        "stall (held_s, switch_s)"
    )
