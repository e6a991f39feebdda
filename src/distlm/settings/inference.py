"""`inference` (the pipeline-parallel generator of the batch stage and of serve, with the
sampling defaults), `SamplingSettings` (how one sequence picks its tokens) and `serve` (the API
server in front of the pipeline)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints

from distlm.core.section import ONLY_WHEN_SET
from distlm.settings.base import (
    MaxNewTokens,
    Real,
    Section,
    Seed,
    StageConfig,
    Temperature,
    TopK,
    TopP,
)
from distlm.settings.runtime import DeviceSettings


class SamplingSettings(Section):
    """How one sequence picks its tokens: the one definition of the sampling keys and ranges.
    `inference` is one (EngineSettings extends it: its flat keys are these), and so is every API
    request's sampling, laid over it (distlm.inference.request.sampling_settings). What the
    sampler acts on is made from it by distlm.inference.sampling_params.make_params."""

    max_new_tokens: MaxNewTokens = Field(
        default=32, description="New tokens per prompt in the batch stage (fewer at end-of-text)."
    )
    temperature: Temperature = Field(
        default=0.0,
        description=(
            "Logits are divided by it before sampling; 0 = greedy (argmax, token-identical to "
            "Hugging Face generate). In serve mode the default of a request."
        ),
    )
    top_k: TopK = Field(
        default=0,
        description="Keep the k most likely tokens before sampling; 0 = all. Serve: the default.",
    )
    top_p: TopP = Field(
        default=1.0,
        description=(
            "Keep the smallest set of tokens holding this much probability; 1 = all. Serve: the "
            "default."
        ),
    )
    seed: Seed = Field(
        default=0,
        description="Sampling seed; prompt i of the batch stage uses seed + i (mod 2^63). Serve: the default.",
    )


class PipelineSettings(Section):
    """`inference.stages` alone: what rule shard reads."""

    stages: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Pipeline stages = MPI ranks = shards; at most the model's layers.",
    )


class EngineSettings(SamplingSettings):
    """The pipeline engine's settings and the sampling defaults: `inference` but its stage count
    and the batch stage's prompt file (what the serve stage reads; its stage count is
    serve.stages). Its sampling keys are SamplingSettings' own: it is the batch stage's sampling
    and every request's defaults as it is, never copied into another model."""

    lanes: int = Field(
        default=64,
        ge=1,
        description=(
            "Sequences in flight at once (KV-cache rows); 64 decodes 64 clients together "
            "(benchmarks/inference/serve-results.json)."
        ),
    )
    prompt_overflow: Literal["truncate", "reject"] = Field(
        default="truncate",
        description=(
            "A prompt longer than context - max_new_tokens: truncate keeps its last tokens, "
            "reject is an error."
        ),
    )
    timeout_s: Real = Field(
        default=120,
        gt=0,
        description="Stage 0 waits this long for tokens, other stages twice this; then abort.",
    )
    cuda_graphs: bool = Field(
        default=True,
        **ONLY_WHEN_SET,
        description=(
            "On a GPU, decode steps run as CUDA graphs (captured per block of cache rows and "
            "span of positions); "
            "false: every step eager (vLLM's --enforce-eager), to compare or to debug. The CPU "
            "runs eagerly either way."
        ),
    )
    steps_in_flight: int = Field(
        default=1,
        ge=1,
        le=2,
        **ONLY_WHEN_SET,
        description=(
            "Micro-batches a one-stage pipeline keeps on its device at once: 2 splits the "
            "running sequences in two and overlaps the host's work on one's tokens with the "
            "device's on the other; 1 runs a step at a time (on the CPU, whose forward pass is "
            "the host's own work, 2 is slower: docs/performance.md)."
        ),
    )


class InferenceSettings(EngineSettings, PipelineSettings):
    """`inference`: the pipeline-parallel generator, its sampling defaults and the batch stage's
    prompts."""

    prompts: str = Field(
        default="config/prompts.txt",
        description="Prompt file of the batch stage: UTF-8, one prompt per non-blank line.",
    )


EnvName = Annotated[str, StringConstraints(pattern="^[A-Za-z_][A-Za-z0-9_]*$")]
FilePath = Annotated[str, StringConstraints(min_length=1)]


class ServePipelineSettings(Section):
    """`serve.stages` and `serve.model`: what rule serve_shard reads."""

    stages: int = Field(
        default=1,
        ge=1,
        description=(
            "Pipeline stages (MPI ranks) of the served model, sharded for serve alone; 1 serves "
            "best on one machine (benchmarks/inference/serve-results.json), more split a model "
            "too big for one device."
        ),
    )
    model: Literal["trained", "base"] = Field(
        default="trained",
        description=(
            "What serve starts from: the trained model (results/train/final, after training) or "
            "the base model (before training: with follow_training, the server takes each "
            "checkpoint the training run pushes)."
        ),
    )


class ServeSettings(ServePipelineSettings):
    """The API server of rule serve (config/README.md, "Serving"). The bearer token is never a
    config value: token_env names an environment variable, token_file a file that holds it."""

    host: str = Field(
        default="127.0.0.1", description="Bind address; loopback only unless changed."
    )
    port: int = Field(
        default=8000, ge=0, le=65535, description="Port (--port overrides it for one run)."
    )
    follow_training: bool = Field(
        default=False,
        description=(
            "Take the weights the training run of this folder pushes at each checkpoint "
            "(results/serve/endpoint.json says where the server listens while it is up; "
            'docs/serving.md, "Serve while training").'
        ),
    )
    api_servers: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "HTTP processes on the one listening socket, each with its own channel to stage 0 "
            "(at most the host's cores)."
        ),
    )
    token_env: EnvName | None = Field(
        default=None, description="Name of an environment variable holding the bearer token."
    )
    token_file: FilePath | None = Field(
        default=None, description="Path of a file holding the bearer token."
    )
    max_tokens: int = Field(
        default=256, ge=1, description="Largest max_tokens a request may ask for (400 above it)."
    )
    max_request_bytes: int = Field(
        default=65536, ge=256, description="Larger request bodies get 413 (counted as read)."
    )
    max_header_bytes: int = Field(
        default=16384, ge=1024, description="A larger request head gets 400."
    )
    max_json_depth: int = Field(
        default=32, ge=2, le=1000, description="Deeper nesting of JSON arrays and objects gets 400."
    )
    max_number_digits: int = Field(
        default=64, ge=1, le=4300, description="A JSON number with more characters gets 400."
    )
    max_connections: int = Field(
        default=10000, ge=1, description="Concurrent connections an API process; more get 503."
    )
    stream_interval: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="A stream chunk goes out once a choice has this many new tokens (or ends).",
    )
    max_queued_sequences: int = Field(
        default=64,
        ge=0,
        description="Sequences that may wait for a lane; a request that does not fit gets 429.",
    )
    backlog: int = Field(default=2048, ge=1, description="Listen backlog.")
    header_timeout_s: Real = Field(
        default=10, gt=0, description="A request head must arrive within this; else 408."
    )
    body_timeout_s: Real = Field(
        default=30,
        gt=0,
        description="The body must arrive within this once the head is in; else 408.",
    )
    keep_alive_timeout_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection is closed after this."
    )
    linger_s: Real = Field(
        default=5,
        gt=0,
        description="Lingering close after an early error: read and discard this long.",
    )
    linger_bytes: int = Field(
        default=134217728, ge=0, description="Lingering close: discard at most this many bytes."
    )
    request_timeout_s: Real = Field(
        default=600,
        gt=0,
        description="A completion not finished within this gets 504 and is cancelled.",
    )


# ----------------------------------------------------------------------------- the stage's keys


class InferenceConfig(StageConfig):
    STAGE: ClassVar[str] = "inference"
    KIND: ClassVar[str] = "distlm-config-inference"
    runtime: DeviceSettings
    inference: InferenceSettings


class ServeConfig(StageConfig):
    STAGE: ClassVar[str] = "serve"
    KIND: ClassVar[str] = "distlm-config-serve"
    runtime: DeviceSettings
    inference: EngineSettings
    serve: ServeSettings
