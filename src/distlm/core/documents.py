"""Documents between stages and messages between ranks: named, versioned types (pydantic).

    write_document(path, doc)                  # atomically, with its "format" tag first
    doc = read_document(path, EvalReport)      # refuses another kind or version, naming the file
    blob = encode(msg); msg = decode(blob, TransferStats)   # the same, for messages between ranks

Each type carries `KIND` and `VERSION`; the JSON holds `"format": "<kind>/<version>"`. A reader
refuses a document of another kind or version, and a malformed one, with an error that names the
file and the field. Unknown fields are refused too: a writer that adds a field bumps the version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from distlm import DistlmError
from distlm.core.io import digest, write_json

D = TypeVar("D", bound="Document")


class DocumentError(DistlmError):
    """A document or message is missing, of another kind or version, or malformed."""


class Document(BaseModel):
    """Base of every document and message: strict fields, a kind and a version."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str]
    VERSION: ClassVar[int]

    @classmethod
    def tag(cls) -> str:
        return f"{cls.KIND}/{cls.VERSION}"

    def to_json(self) -> dict:
        return {"format": self.tag(), **self.model_dump(mode="json")}

    @classmethod
    def from_json(cls, obj: object, where: str) -> Self:
        """Check the format tag, then every field; errors name `where` and the field."""
        if not isinstance(obj, dict):
            raise DocumentError(f"{where}: expected a {cls.tag()} object, got {type(obj).__name__}")
        found = obj.get("format")
        if found != cls.tag():
            what = "no format tag" if found is None else f"a {found!r} document"
            raise DocumentError(
                f"{where}: {what} where {cls.tag()!r} ({cls.__name__}) was expected"
                + (
                    "; it was written by another version of distlm: rerun the stage that wrote it"
                    if isinstance(found, str) and found.split("/")[0] == cls.KIND
                    else ""
                )
            )
        body = {k: v for k, v in obj.items() if k != "format"}
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "<top level>"
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            raise DocumentError(
                f"{where}: malformed {cls.__name__}: field {field}: {err['msg']}{more}"
            ) from None


def write_document(path: str | os.PathLike, doc: Document) -> None:
    """Write `doc` atomically (distlm.core.io) with its format tag."""
    write_json(path, doc.to_json())


def read_document(path: str | os.PathLike, cls: type[D], *, untagged: bool = False) -> D:
    """Read a `cls` document, refusing another kind or version and malformed fields.

    `untagged`: a file without a format tag is read as this version of `cls`. Only for the files
    distlm wrote, with these very fields, before the type carried its tag (a checkpoint's
    state.json, a run folder's identity.json): results of that release read unchanged."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DocumentError(f"{cls.__name__} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DocumentError(f"{path}: malformed {cls.__name__}: not valid JSON ({e})") from None
    if untagged and isinstance(obj, dict) and "format" not in obj:
        obj = {"format": cls.tag(), **obj}
    return cls.from_json(obj, str(path))


def encode(msg: Document) -> bytes:
    """A message between ranks, as bytes."""
    return json.dumps(msg.to_json(), separators=(",", ":")).encode()


def decode(blob: bytes, cls: type[D], where: str) -> D:
    """A message from bytes; `where` names the sender in errors."""
    try:
        obj = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DocumentError(f"{where}: not a {cls.tag()} message ({e})") from None
    return cls.from_json(obj, where)


# ----------------------------------------------------------------------------- dataset prep


class SplitStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    documents: int
    tokens: int
    blocks: int
    tail_tokens_not_in_blocks: int
    tokens_sha256: str


class DataStats(Document):
    """results/data/stats.json: what the dataset-prep stage made of the corpus."""

    KIND: ClassVar[str] = "distlm-data-stats"
    VERSION: ClassVar[int] = 1
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    splits: dict[str, SplitStats]
    seconds: float


class TokenMeta(Document):
    """The token file's metadata (results/data/tokens.h5, distlm.data.tokens): its HDF5 `format`
    attribute is the tag, its `meta` attribute the body, so the file is one document."""

    KIND: ClassVar[str] = "distlm-tokens"
    VERSION: ClassVar[int] = 1
    source: dict
    config_digest: str
    tokenizer: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int


# ----------------------------------------------------------------------------- model folders


class ModelMeta(Document):
    """distlm.json of a model folder (the model stage's, or training's final folder): where the
    weights came from, and the sha256 of model.safetensors that every later stage verifies
    (distlm.model.verify_model_folder). A folder distlm wrote always carries its hash."""

    KIND: ClassVar[str] = "distlm-model"
    VERSION: ClassVar[int] = 1
    created_by: str
    source: dict
    config_digest: str
    data_config_digest: str
    dtype: str
    training: dict | None = None  # the training record; only in training's final folder
    model_sha256: str
    n_layer: int
    n_positions: int
    vocab_size: int
    parameters: int
    arch_digest: str

    def to_json(self) -> dict:
        out = super().to_json()
        if out["training"] is None:  # a model-stage folder: no key, as it always was
            del out["training"]
        return out


class PipelineMeta(ModelMeta):
    """distlm.json of a pipeline folder (rule shard): its source folder's metadata, the source
    folder and the stages' layer ranges."""

    KIND: ClassVar[str] = "distlm-pipeline"
    VERSION: ClassVar[int] = 1
    source_model: str
    stages: list[dict]


class ShardEntry(BaseModel):
    """One stage's shard in shards/manifest.json: its decoder layers [start, end), whether it
    holds the embeddings (the first stage) and the final norm and head (the last), its tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: int
    file: str
    layers: tuple[int, int]
    has_embeddings: bool
    has_head: bool
    tensors: list[str]
    bytes: int
    sha256: str


class ShardManifest(Document):
    """shards/manifest.json of a pipeline folder (rule shard): the stage shards of a model folder,
    cut by its family (distlm.family), with `tied` the last stage's copies of tied tensors
    ({"lm_head.weight": the input embedding}, or {} when the head is its own)."""

    KIND: ClassVar[str] = "distlm-shards"
    VERSION: ClassVar[int] = 1
    stages: int
    n_layer: int
    model_sha256: str
    tied: dict[str, str]
    shards: list[ShardEntry]


# ----------------------------------------------------------------------------- checkpoints


class CheckpointIndex(Document):
    """checkpoint.json of a training checkpoint, written last: the sha256 of every other file."""

    KIND: ClassVar[str] = "distlm-checkpoint"
    VERSION: ClassVar[int] = 1
    step: int
    sha256: dict[str, str]


# A number as the settings hold it: 2 stays the int 2 (a plain `float` would make it 2.0), so an
# identity read back dumps, and digests (its run folder's name), exactly as it was written.
Number = int | float


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IdentityModel(_Part):
    arch_digest: str  # ModelMeta.arch_digest of the base model
    base_model_sha256: str


class IdentityData(_Part):
    config_digest: str  # TokenMeta.config_digest of the token file
    block_size: int
    train_blocks: int
    seed: int  # runtime.seed


class IdentityTopology(_Part):
    """How a step's global batch is cut. Under DDP the whole cut (a checkpoint resumes on the same
    ranks); under FSDP the global batch alone, with `parallel` (its sharded checkpoints reshard:
    a run resumes on any number of ranks, with the same data order). A key left unset is not
    dumped, so a DDP identity digests as it did before FSDP."""

    world_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int
    parallel: str | None = None  # "fsdp"; None: DDP

    @model_serializer(mode="wrap")
    def _set_only(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class IdentityOptim(_Part):
    lr: Number
    min_lr: Number
    warmup_steps: int
    max_steps: int
    weight_decay: Number
    beta1: Number
    beta2: Number
    grad_clip: Number
    precision: str  # the resolved precision (fp32, bf16, fp16), not "auto"


class RunIdentity(Document):
    """What changes a training run's weights: its model, data, topology, optimiser and schedule.
    identity.json of a run folder (results/train/checkpoints/<run id>/) and the `identity` of
    each of its checkpoints' state.json (there without the format tag). The run id, the folder's
    name, is the first 16 hex digits of the sha256 of the fields (`run_id`). Built by
    distlm.train.identity.run_identity, read and written there (read_identity, write_identity)."""

    KIND: ClassVar[str] = "distlm-run-identity"
    VERSION: ClassVar[int] = 1
    model: IdentityModel
    data: IdentityData
    topology: IdentityTopology
    optim: IdentityOptim

    def fields(self) -> dict:
        """The identity without its format tag: what is compared key by key, and digested."""
        return self.model_dump(mode="json")

    @property
    def run_id(self) -> str:
        """The name of the identity's run folder."""
        return digest(self.fields())[:16]


class CheckpointState(Document):
    """state.json of a training checkpoint: what a resume needs beside the tensors."""

    KIND: ClassVar[str] = "distlm-checkpoint-state"
    VERSION: ClassVar[int] = 1
    identity: RunIdentity  # the run's identity (its fields, without the format tag)
    data: dict  # samples consumed, epoch, the sampler's state
    scheduler: dict
    scaler: dict  # empty unless fp16
    metrics: dict  # the metrics history so far
    distlm_version: str
    step: int


# ----------------------------------------------------------------------------- weight broadcast


class ReceiverStats(BaseModel):
    """One receiver's figures, as the sender reports them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int
    seconds: float
    gbps: float | None
    verified: bool
    checksum_seconds: float
    unpack_seconds: float
    mismatches: list[str]


class TransferStats(Document):
    """One rank's figures of a `distlm.transfer` broadcast (also each receiver's report to the
    sender); on the sender `receivers` lists every receiver and `seconds` runs until the last
    one has verified."""

    KIND: ClassVar[str] = "distlm-transfer-stats"
    VERSION: ClassVar[int] = 1
    rank: int
    role: Literal["sender", "receiver"]
    transport: str
    backend: str
    device: str
    src: int
    chain: list[int]
    bytes: int
    stream_bytes: int
    tensors: int
    tied_tensors: int
    buckets: int
    bucket_bytes: int
    chunk_bytes: int
    metadata_seconds: float
    seconds: float
    gbps: float | None
    pack_seconds: float = 0.0
    checksum_seconds: float = 0.0
    unpack_seconds: float = 0.0
    packed_bytes: int = 0
    verified: bool | None
    mismatches: list[str]
    all_verified: bool | None = None
    receivers: list[ReceiverStats] = []


class BroadcastReport(Document):
    """results/broadcast/report.json: the broadcast stage's run, the sender's view."""

    KIND: ClassVar[str] = "distlm-broadcast"
    VERSION: ClassVar[int] = 2
    model: str
    model_sha256: str | None
    world_size: int
    receivers_configured: int
    bucket_mb: float
    chunk_mb: float
    timeout_s: float
    config_digest: str | None
    stats: TransferStats


# ----------------------------------------------------------------------------- evaluation


class SplitEval(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mean_loss: float
    perplexity: float
    tokens_scored: int
    tokens: int
    windows: int
    context: int
    stride: int
    seconds: float
    tokens_per_s: float | None
    tokens_sha256: str
    model_sha256: str | None = None


class EvalReport(Document):
    """results/eval/<model>.json: sliding-window perplexity of one model, per split."""

    KIND: ClassVar[str] = "distlm-eval"
    VERSION: ClassVar[int] = 2
    name: str
    method: str
    model: dict
    data: dict
    context: int
    stride: int
    batch_size: int
    precision: str
    device: str
    world_size: int
    config_digest: str
    splits: dict[str, SplitEval]
    seconds: float


# ----------------------------------------------------------------------------- training profile


class ProfileWindow(_Part):
    wait: int
    warmup: int
    active: int


class ProfileSummary(Document):
    """results/train/profile/profile.json (distlm.train.profiling, rank 0): whether profiling was
    on, its window of steps, and whether a window was captured (why not, if not). The per-rank
    top-ops-rank<r>.json beside it are tables (like metrics.csv), data files, not documents."""

    KIND: ClassVar[str] = "distlm-train-profile"
    VERSION: ClassVar[int] = 1
    enabled: bool
    window: ProfileWindow
    captured: bool | None = None  # None (no key): profiling off
    first_step: int | None = None
    reason: str | None = None  # only when on and nothing was captured

    def to_json(self) -> dict:
        # the keys of a field that does not apply are absent, as the file always had them
        return {k: v for k, v in super().to_json().items() if v is not None}


# ----------------------------------------------------------------------------- inference


class Ttft(_Part):
    mean: float
    max: float


class InferenceTiming(Document):
    """results/inference/timing.json (distlm.inference.engine.batch): one run of the inference
    stage: its shape, throughput, time to first token, and per prompt (Sequence.timing), per
    stage (StageStats) and per host (StageInfo) the engine's own records. `per_stage`, `hosts` and
    `model` are filled in by run_batch after the pipeline stops (generate_batch leaves them)."""

    KIND: ClassVar[str] = "distlm-inference-timing"
    VERSION: ClassVar[int] = 1
    stages: int
    lanes: int
    micro_batch_size: int
    prompts: int
    tokens: int
    wall_s: float
    tokens_per_s: float | None  # None: the run took no measurable time
    ttft_s: Ttft
    per_prompt: list[dict]
    per_stage: list[dict] = []
    hosts: list[dict] = []
    model: str | None = None

    def facts(self) -> dict:
        """The run's scalar fields (what the report lists); `model` only when filled in."""
        return {
            k: v
            for k, v in self.model_dump(mode="json").items()
            if not isinstance(v, (list, dict)) and not (k == "model" and v is None)
        }


class InferenceSweep(Document):
    """A timing file of several inference runs (over stage counts and lanes), as the report
    draws a sweep of them: {"runs": [InferenceTiming fields, ...]}."""

    KIND: ClassVar[str] = "distlm-inference-sweep"
    VERSION: ClassVar[int] = 1
    runs: list[InferenceTiming]


# ----------------------------------------------------------------------------- trainer -> launcher

# The file a launcher asks the trainer to write its StopNotice to (distlm-launch srun-torchrun).
STOP_NOTICE_ENV = "DISTLM_STOP_NOTICE"


class StopNotice(Document):
    """Training stopped on a signal at a step boundary, with that step's checkpoint written."""

    KIND: ClassVar[str] = "distlm.train.stop_notice"
    VERSION: ClassVar[int] = 1
    step: int  # optimizer steps done: the checkpoint written, where the next attempt resumes
    max_steps: int
    signals: list[str]  # the stop signals that reached some rank, e.g. ["SIGUSR1"]
    checkpoint_run: str  # the run identity's checkpoint folder
    slurm_job: str | None  # SLURM_JOB_ID of the allocation that stopped
