"""The engine channel: named, versioned messages between the API server and stage 0 (msgpack).

The API server (`distlm.inference.server.client`, outside the MPI job) and stage 0's engine
(`distlm.inference.engine.serve`) speak over two ZeroMQ PUSH/PULL sockets on IPC, as vLLM's
frontend and engine do. Every frame is `[VERSION, kind, {field: value}]`, or
`[VERSION, "batch", [[kind, {field: value}], ...]]` for the messages of one engine step together (one
frame per step, not one per token). Each message is a typed dataclass, its fields checked by pydantic on the way in
(a Submit's `params` is a SamplingParams, a Ready's `pipeline` StageInfos, ...); a frame of
another version, an unknown kind, missing/extra fields or a field of the wrong type raises
ChannelError instead of being guessed at.

Versioning as documents do it (distlm.core.documents), one number for the whole channel, since both
ends ship together: bump VERSION when a message changes shape.

    API server -> engine:  Attach, Submit, Cancel, Shutdown, Update
    engine -> API server:  Ready, Prompt, TokenBatch, Finish, Error, Health, Updated
    supervisor -> API server process:  Control (on the process's stdin, `pipe_frame`)

Each API server process has a channel of its own (`endpoints(folder, k)`: k = 0 is the
supervisor, which watches the engine and submits nothing; 1..serve.api_servers serve HTTP), so
stage 0 knows whose request it runs and sends its events there alone; Ready, Health and a
pipeline's Error go to every channel.

A step's new tokens for a channel travel as one TokenBatch (columns: request, choice, token, and
the log-probabilities when asked), not as a message a token: stage 0 builds it with appends and
packs it once, and the API server checks it once (pydantic, in Rust) and hands each token on as a
`Token`, the API server's own event. A message a token cost stage 0 ~2.5 us a token, 0.13 ms of
a 64-row decode step's host time (docs/performance.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Literal

import msgpack
from pydantic import ConfigDict, TypeAdapter, ValidationError

from distlm import DistlmError
from distlm.inference.sampling_params import SamplingParams
from distlm.inference.stats import StageBrief, StageInfo
from distlm.transfer.documents import PushOffer

# 2: Prompt (the prompt's log-probabilities, echo with logprobs)
# 3: typed fields: Submit.params SamplingParams, Ready.pipeline StageInfo, Health.stages StageBrief
# 4: a channel per API server process: Attach; the supervisor's Control; StageBrief's device_s
#    and micro_batches (in Health)
# 5: Ready.weights
# 6: Update, Updated (live weight updates); Ready.last_update
# 7: Update.push (weights pushed from the training ranks)
# 8: the push's offer carries its key (distlm.transfer.push seals asks and parts with it);
#    Updated.stall, UpdateRecord.stall
# 9: the push's offer names its transport and the sender's device (PushDevice), not a backend
# 10: a step's tokens as one TokenBatch (columns), not a Token message each
VERSION = 10
_CHECKED = ConfigDict(extra="forbid")  # unknown fields refused, types checked


class ChannelError(DistlmError):
    """A frame on the engine channel that is not a message of this version."""


def fingerprint(weights: str) -> str:
    """OpenAI's `system_fingerprint` of every answer: which weights (their digest) produced it."""
    return f"fp_{weights[:16]}"


# ----------------------------------------------------------------------------- API server -> engine


@dataclass(frozen=True)
class Attach:
    """An API server process (re)started on its channel: stage 0 cancels what the channel's
    previous process had open (its clients went with it) and answers Ready on the channel."""

    __pydantic_config__ = _CHECKED

    pid: int


@dataclass(frozen=True)
class Submit:
    """A completions request: each prompt (token ids) gets `n` choices; index = prompt * n + j.

    Choice j > 0 of a prompt samples with seed + j (mod 2^63: settings.derived_seed).
    """

    __pydantic_config__ = _CHECKED

    rid: int
    prompts: list[list[int]]
    n: int
    params: SamplingParams


@dataclass(frozen=True)
class Cancel:
    """Stop a request's sequences (client gone, timed out), or one choice (a stop string seen)."""

    __pydantic_config__ = _CHECKED

    rid: int
    index: int | None = None  # None: every choice of the request


@dataclass(frozen=True)
class Shutdown:
    """Stop the pipeline in order (Ctrl-C / SIGTERM on the API server)."""

    __pydantic_config__ = _CHECKED

    reason: str = "the server is shutting down"


# how in-flight requests meet a live weight update (Update.policy): `wait` (the default) holds new
# requests while the running ones end on the old weights, `abort` ends the running ones now
Policy = Literal["wait", "abort"]


@dataclass(frozen=True)
class Update:
    """Load new weights into the running pipeline, from `path` (a model folder, a pipeline folder
    or a whole training checkpoint, on the stages' filesystem) or from `push` (a sender's offer:
    each stage fetches its part, distlm.transfer.push); in-flight requests follow `policy` (wait:
    they end on the old weights while new ones queue; abort: they end now with finish reason
    "abort"). Stage 0 answers Updated."""

    __pydantic_config__ = _CHECKED

    rid: int
    path: str = ""
    push: PushOffer | None = None
    policy: Policy = "wait"


# ----------------------------------------------------------------------------- engine -> API server


@dataclass(frozen=True)
class Stall:
    """What an update cost the requests (0 when it did not switch): `held_s`, how long new
    requests were held (policy wait: the running ones ending on the old weights, then the switch;
    abort: the switch); `switch_s`, from the pipeline's last step on the old weights to every
    stage holding the new ones (the copies in, and the Swap's round of the ring): the time the
    update alone stops every token."""

    __pydantic_config__ = _CHECKED

    held_s: float = 0.0
    switch_s: float = 0.0


@dataclass(frozen=True)
class UpdateRecord:
    """An update that switched the weights: where from, and what it cost."""

    __pydantic_config__ = _CHECKED

    source: str
    kind: str  # model folder, pipeline folder, training checkpoint, training push
    weights: str  # the weights' digest after it
    seconds: float  # from the request to every stage serving them
    bytes: int  # staged, over every stage
    at: float  # when it ended (Unix time)
    stall: Stall = Stall()


@dataclass(frozen=True)
class Ready:
    """Stage 0 is up; what the API server needs to validate and tokenize requests."""

    __pydantic_config__ = _CHECKED

    hostname: str
    pid: int
    context: int
    vocab_size: int
    eos_token_id: int | None
    lanes: int
    stages: int
    pipeline: list[StageInfo]
    weights: str  # the served weights' digest (the shard manifest's model_sha256, or an update's)
    last_update: UpdateRecord | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.weights)


@dataclass(slots=True)
class Token:
    """One new token of choice `index` of request `rid` (with log-probabilities when asked): an
    entry of a TokenBatch, as the API server hands it to the request's answer (not sent alone).
    Not frozen: a frozen dataclass's __init__ costs ~0.5 us more, and one is made a token."""

    rid: int
    index: int
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # [(token id, logprob), ...]


@dataclass
class TokenBatch:
    """New tokens in order, as columns: entry k is token `token[k]` of choice `index[k]` of
    request `rid[k]`; `logprob` and `top` are None when no entry carries log-probabilities, else
    an entry each (None for an entry without). Built by `add` on stage 0 (so not frozen)."""

    __pydantic_config__ = _CHECKED

    rid: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    logprob: list[float | None] | None = None
    top: list[list[tuple[int, float]] | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.rid)
        columns = (self.index, self.token, self.logprob, self.top)
        if any(c is not None and len(c) != n for c in columns):
            raise ValueError(f"columns of unequal length ({n} requests)")

    def add(
        self,
        rid: int,
        index: int,
        token: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        if logprob is not None and self.logprob is None:
            self.logprob = list[float | None]([None] * len(self.rid))
        if top is not None and self.top is None:
            self.top = list[list[tuple[int, float]] | None]([None] * len(self.rid))
        self.rid.append(rid)
        self.index.append(index)
        self.token.append(token)
        if self.logprob is not None:
            self.logprob.append(logprob)
        if self.top is not None:
            self.top.append(top)

    def tokens(self) -> list[Token]:
        """The entries, in order."""
        n = len(self.rid)
        lps = self.logprob if self.logprob is not None else [None] * n
        tops = self.top if self.top is not None else [None] * n
        return [Token(*e) for e in zip(self.rid, self.index, self.token, lps, tops, strict=True)]


@dataclass(frozen=True)
class Prompt:
    """The prompt's log-probabilities of choice `index` of `rid`, from its prefill (echo with
    logprobs): one entry per prompt token, the first None (nothing comes before it)."""

    __pydantic_config__ = _CHECKED

    rid: int
    index: int
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]  # per prompt token: [(token id, logprob), ...]


@dataclass(frozen=True)
class Finish:
    """Choice `index` of request `rid` is done: reason stop, length or cancelled."""

    __pydantic_config__ = _CHECKED

    rid: int
    index: int
    reason: str
    tokens: int


@dataclass(frozen=True)
class Error:
    """Choice `index` of `rid` failed (status 500); rid None: the whole pipeline failed (503)."""

    __pydantic_config__ = _CHECKED

    rid: int | None
    index: int | None
    status: int
    message: str


@dataclass(frozen=True)
class Health:
    """Stage 0's state, sent every `every_s` seconds while it runs."""

    __pydantic_config__ = _CHECKED

    active: int
    waiting: int
    lanes_busy: int
    stages: list[StageBrief] = field(default_factory=list)  # each stage's, as stage 0 last saw


@dataclass(frozen=True)
class Updated:
    """How Update `rid` ended: `status` 200 (`changed` False: those weights were served
    already), 400 (refused or not staged: the old weights serve on, `message` says why) or 409
    (another update is in progress). `weights`: the digest served after it."""

    __pydantic_config__ = _CHECKED

    rid: int
    status: int
    message: str
    weights: str
    changed: bool
    seconds: float
    bytes: int
    stall: Stall = Stall()


# ----------------------------------------------------------------------------- supervisor -> API server


@dataclass(frozen=True)
class Control:
    """The supervisor's word to an API server process: `stopping` (new requests get 503, open
    ones go on) or `failed` (every open and new request gets 503 with `reason`; the process
    exits once they are answered). `error`: False for a requested stop (logged as information)."""

    __pydantic_config__ = _CHECKED

    state: Literal["stopping", "failed"]
    reason: str
    error: bool = True


Message = (
    Attach
    | Submit
    | Cancel
    | Shutdown
    | Update
    | Ready
    | Prompt
    | TokenBatch
    | Finish
    | Error
    | Health
    | Updated
    | Control
)
_KINDS: dict[str, type] = {
    c.__name__.lower(): c
    for c in (
        Attach,
        Submit,
        Cancel,
        Shutdown,
        Update,
        Ready,
        Prompt,
        TokenBatch,
        Finish,
        Error,
        Health,
        Updated,
        Control,
    )
}


# kind -> the pydantic adapter that checks a message's fields (built once: building is slow)
_ADAPTERS: dict[str, TypeAdapter] = {kind: TypeAdapter(cls) for kind, cls in _KINDS.items()}


def _fields(msg: Message) -> list:
    kind = type(msg).__name__.lower()
    if _KINDS.get(kind) is not type(msg):
        raise ChannelError(f"not an engine-channel message: {type(msg).__name__}")
    return [kind, _ADAPTERS[kind].dump_python(msg)]


def _pack(frame: list) -> bytes:
    out = msgpack.packb(frame)
    assert out is not None  # None only with autoreset=False, which packb does not use
    return out


def encode(msg: Message) -> bytes:
    return _pack([VERSION, *_fields(msg)])


def encode_batch(msgs: list[Message]) -> bytes:
    """Several messages in one frame, in order (decode_all reads it)."""
    return _pack([VERSION, "batch", [_fields(m) for m in msgs]])


def _unpack(frame: bytes) -> tuple[str, object]:
    try:
        version, kind, fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ChannelError(f"undecodable frame of {len(frame)} bytes ({e})") from None
    if version != VERSION:
        raise ChannelError(f"message version {version!r}, this side speaks {VERSION}")
    return kind, fields


def decode(frame: bytes) -> Message:
    return _message(*_unpack(frame))


def decode_all(frame: bytes) -> list[Message]:
    """The messages of a frame: one, or a batch's in order."""
    kind, fields = _unpack(frame)
    if kind != "batch":
        return [_message(kind, fields)]
    if not isinstance(fields, list) or not all(isinstance(m, list) and len(m) == 2 for m in fields):
        raise ChannelError("batch: expected a list of [kind, fields] pairs")
    return [_message(k, f) for k, f in fields]


def _message(kind, fields) -> Message:
    adapter = _ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None or not isinstance(fields, dict):
        raise ChannelError(f"unknown message kind {kind!r}")
    try:
        return adapter.validate_python(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "message"
        raise ChannelError(
            f"{kind}: fields {sorted(fields)}: {where}: {err['msg']} ({e.error_count()} errors)"
        ) from None


def endpoints(folder: str, process: int) -> tuple[str, str]:
    """The channel of API server process `process` (0: the supervisor): its requests socket and
    its events socket, IPC in the server's private folder. The API process binds both."""
    return f"ipc://{folder}/requests-{process}", f"ipc://{folder}/events-{process}"


_LENGTH = struct.Struct("!I")


def pipe_frame(msg: Message) -> bytes:
    """A message as it goes down a pipe: its length (4 bytes), then its frame."""
    frame = encode(msg)
    return _LENGTH.pack(len(frame)) + frame


async def read_pipe_frame(reader) -> Message | None:
    """The next message of a pipe (an asyncio.StreamReader); None at its end."""
    import asyncio

    try:
        head = await reader.readexactly(_LENGTH.size)
        return decode(await reader.readexactly(_LENGTH.unpack(head)[0]))
    except asyncio.IncompleteReadError:
        return None
