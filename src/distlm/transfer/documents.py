"""What a weight transfer reports: each rank's figures (`TransferStats`, also each receiver's
report to the sender); a push of weights into a running server: where the server listens
(`ServeEndpoint`, the route `PUSH_ROUTE`), what the sender offers and each stage asks
(`PushOffer`, `PushWant`: distlm.transfer.push). The server's side is distlm.inference, the
training ranks' distlm.train.pushes; both read these here, below them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from distlm.core.documents import Document

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
    receivers: list[ReceiverStats] = Field(default_factory=list)


# ----------------------------------------------------------------------------- push into a server


class PushDevice(BaseModel):
    """Where one side of a push holds its tensors: host memory (`gpu` None), or the GPU of UUID
    `gpu`, the same in every process that sees that GPU whatever its index there (two processes
    on one GPU name the same)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    gpu: str | None = Field(default=None, pattern=r"^[A-Za-z0-9\-]{1,64}$")

    @classmethod
    def of(cls, device) -> PushDevice:
        """The PushDevice of a torch.device."""
        from distlm.runtime.device import gpu_uuid

        return cls(gpu=gpu_uuid(device))

    def same_gpu(self, other: PushDevice) -> bool:
        """Whether both are the one GPU (NCCL refuses a group with two ranks on it)."""
        return self.gpu is not None and self.gpu == other.gpu


class PushOffer(BaseModel):
    """What the server is told to fetch: the sender's store, the group's name, the push's key,
    the weights' digest (what the answers' system_fingerprint will name), the transfer's
    settings and where the sender holds the weights (`device`: with each stage's, it says how
    that stage's part travels: distlm.transfer.push.route_for).

    The key is the push's secret: it goes to the server in the (authenticated) offer alone, never
    into the store, which anyone who reaches its port can read (torch's TCPStore has no
    authentication). Each stage seals its ask with it and the sender seals each stage's part
    (distlm.transfer.push), so a process that reaches the store without the offer can neither
    have weights sent to it nor have its own taken for the sender's."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_\-\[\]]+$")
    port: int = Field(ge=1, le=65535)
    group: str = Field(pattern=r"^[A-Za-z0-9_\-]{8,64}$")
    key: str = Field(pattern=r"^[0-9a-f]{64}$", repr=False)  # 32 random bytes, hex
    # the data plane (the trainer's transfer.transport) and the sender's device
    transport: Literal["torch", "uccl"] = "torch"
    device: PushDevice = Field(default_factory=PushDevice)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    label: str = Field(default="", max_length=200)  # what /health and the logs name it by
    # the sender's model (distlm.family's ModelArgs.signature(), config.json's names): the
    # server refuses another before any stage stages
    architecture: dict[str, str | int | float | bool | None] = Field(max_length=64)
    bucket_mb: float = Field(default=64, gt=0, le=4096)
    chunk_mb: float = Field(default=4, gt=0, le=4096)
    timeout_s: float = Field(default=60, gt=0, le=3600)

    @property
    def where(self) -> str:
        return f"push {self.label or self.group} from {self.host}:{self.port}"

    def settings(self):
        """The transfer's settings, the same on both sides (distlm.settings.TransferSettings)."""
        from distlm.settings import TransferSettings

        return TransferSettings(
            transport=self.transport,
            bucket_mb=self.bucket_mb,
            chunk_mb=self.chunk_mb,
            timeout_s=self.timeout_s,
        )


# what an ask may name at most: the sender reads asks from a store anyone who reaches it may write
MAX_STAGES, MAX_TENSORS = 1024, 100_000
MAX_ASK_BYTES = 64 << 20


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    shape: list[int] = Field(max_length=8)
    dtype: Literal["float32", "bfloat16", "float16", "float64"]


class PushWant(Document):
    """A stage's ask of the sender: its tensors (transformers' names) as it will hold them, and
    its device."""

    KIND: ClassVar[str] = "distlm-push-want"
    VERSION: ClassVar[int] = 3
    stage: int = Field(ge=0, le=MAX_STAGES - 1)
    stages: int = Field(ge=1, le=MAX_STAGES)
    tensors: dict[str, TensorSpec] = Field(max_length=MAX_TENSORS)
    # a tied copy -> its source (the sender may hold only the source)
    tied: dict[str, str] = Field(max_length=MAX_TENSORS)
    device: PushDevice

    def template(self, device) -> dict:
        """Tensors to receive into, on `device` (a torch.device: where the part lands)."""
        import torch

        return {
            n: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)
            for n, s in self.tensors.items()
        }

    @property
    def nbytes(self) -> int:
        """The bytes of the part it asks for."""
        import math

        import torch

        return sum(
            math.prod(s.shape) * getattr(torch, s.dtype).itemsize for s in self.tensors.values()
        )

    @classmethod
    def of(
        cls, tensors: Mapping, *, stage: int, stages: int, tied: dict[str, str], device
    ) -> PushWant:
        """The ask for `tensors` (name -> a torch.Tensor as the stage holds it) by a stage on
        `device` (a torch.device)."""
        specs = {
            n: TensorSpec.model_validate(
                {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            )
            for n, t in tensors.items()
        }
        return cls(
            stage=stage, stages=stages, tensors=specs, tied=tied, device=PushDevice.of(device)
        )


# the server's route that takes a push (distlm.inference.server.updates)
PUSH_ROUTE = "/update_weights_from_distributed"


class ServeEndpoint(Document):
    """results/serve/endpoint.json, while a server that follows the training run is up
    (serve.follow_training): where the training ranks push each checkpoint (distlm.train.pushes).
    It names the token's source (serve.token_env, serve.token_file), never the token."""

    KIND: ClassVar[str] = "distlm-serve-endpoint"
    VERSION: ClassVar[int] = 1
    url: str = Field(pattern=r"^http://[A-Za-z0-9.:_\-\[\]]+$", max_length=300)  # http://host:port
    hostname: str  # the supervisor's host
    pid: int  # the supervisor's
    token_env: str | None = None
    token_file: str | None = None
