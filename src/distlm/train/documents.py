"""The training stage's documents: a checkpoint's index and state, the run identity
(identity.json), the profile's summary, and the stop notice the trainer leaves its launcher."""

from __future__ import annotations

from typing import ClassVar

from pydantic import SerializerFunctionWrapHandler, model_serializer

from distlm.core.documents import Document, Number, Part
from distlm.core.io import digest

# ----------------------------------------------------------------------------- checkpoints


# A number as the settings hold it: 2 stays the int 2 (a plain `float` would make it 2.0), so an
# identity read back dumps, and digests (its run folder's name), exactly as it was written.
class IdentityModel(Part):
    arch_digest: str  # ModelMeta.arch_digest of the base model
    base_model_sha256: str


class IdentityData(Part):
    config_digest: str  # TokenMeta.config_digest of the token file
    block_size: int
    train_blocks: int
    seed: int  # runtime.seed


class IdentityTopology(Part):
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


class IdentityOptim(Part):
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


# ----------------------------------------------------------------------------- training profile


class ProfileWindow(Part):
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
