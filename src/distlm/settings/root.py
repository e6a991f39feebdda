"""`Settings`: the whole config, with the checks that span keys and the keys that moved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from distlm import DistlmError
from distlm.family import ModelArgs, model_args, spec_of
from distlm.runtime.machine import may_use_gpu
from distlm.settings.base import ConfigError, Section
from distlm.settings.data import DataSettings
from distlm.settings.eval import EvalSettings
from distlm.settings.inference import InferenceSettings, ServeSettings
from distlm.settings.model import ModelSettings
from distlm.settings.report import ReportSettings
from distlm.settings.runtime import RuntimeSettings
from distlm.settings.sweep import SweepSettings, _no_default
from distlm.settings.train import TrainSettings
from distlm.settings.transfer import BroadcastSettings, TransferSettings

# Keys of earlier releases: a config that still sets one is refused with where it went (no
# silent aliasing: two spellings of one key would make a rerun depend on which one a file uses).
MOVED: dict[str, str] = {
    "broadcast.transport": "moved to transfer.transport (it drives training's weight transfer too)",
    "broadcast.bucket_mb": "moved to transfer.bucket_mb (it drives training's weight transfer too)",
    "broadcast.chunk_mb": "moved to transfer.chunk_mb (it drives training's weight transfer too)",
    "broadcast.timeout_s": "moved to transfer.timeout_s (it drives training's weight transfer too)",
    "inference.greedy": (
        "removed: greedy decoding is inference.temperature: 0 (any temperature above 0 samples)"
    ),
}


def moved_keys(raw: Any) -> list[str]:
    """`key: where it went` for every key of `raw` (a config mapping) that moved."""
    out = []
    if isinstance(raw, dict):
        for key, why in MOVED.items():
            section, name = key.split(".")
            if isinstance(raw.get(section), dict) and name in raw[section]:
                out.append(f"{key}: {why}")
    return out


class Settings(Section):
    """The whole workflow config: one file configures every stage. Unknown keys are rejected,
    defaults are filled in, ranges are checked. config/README.md explains every key."""

    runtime: RuntimeSettings = Field(
        default=RuntimeSettings(), description="Where every stage runs."
    )
    data: DataSettings = Field(
        default=DataSettings(), description="The corpus and its token blocks."
    )
    model: ModelSettings = Field(default=ModelSettings(), description="The base model.")
    transfer: TransferSettings = Field(
        default=TransferSettings(),
        description=(
            "How a model's weights move between ranks: the broadcast stage and training's "
            "initial weights."
        ),
    )
    broadcast: BroadcastSettings = Field(
        default=BroadcastSettings(), description="The weight-broadcast stage's world."
    )
    train: TrainSettings = Field(default=TrainSettings(), description="Data-parallel training.")
    eval: EvalSettings = Field(
        default=EvalSettings(),
        description="Sliding-window perplexity of the base and the trained model.",
    )
    inference: InferenceSettings = Field(
        default=InferenceSettings(),
        description="Pipeline-parallel generation and its sampling defaults.",
    )
    serve: ServeSettings = Field(
        default=ServeSettings(),
        description=(
            'The API server of rule serve (config/README.md, "Serving"). The bearer token is '
            "never a config value: token_env names an environment variable, token_file a file "
            "that holds it."
        ),
    )
    report: ReportSettings = Field(default=ReportSettings(), description="Figures and the summary.")
    sweep: SweepSettings | None = Field(
        default=None,
        description=(
            "Not a stage's setting: named runs over this base config (docs/sweeps.md; "
            "distlm.dag.sweep). Absent: one run, today's paths."
        ),
        json_schema_extra=_no_default,
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, raw: Any) -> Any:
        moved = moved_keys(raw)
        if moved:
            raise ValueError("\n  ".join(moved))
        return raw

    @model_validator(mode="after")
    def _check_across_keys(self) -> Settings:
        problems = consistency_problems(self)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self


def consistency_problems(s: Settings) -> list[str]:
    """Constraints that span keys; known before any job starts. Each names its key."""
    problems = []
    arch = known_architecture(s.model)
    ev = s.eval
    if arch is not None:
        n_layer, n_positions = arch
        for key, stages in (("inference", s.inference.stages), ("serve", s.serve.stages)):
            if stages > n_layer:
                problems.append(
                    f"{key}.stages: {stages} pipeline stages but the model has only {n_layer} "
                    "layers"
                )
        if s.data.block_size > n_positions:
            problems.append(
                f"data.block_size: {s.data.block_size} is beyond the model's context "
                f"of {n_positions} positions"
            )
        if ev.context is not None and ev.context > n_positions:
            problems.append(
                f"eval.context: {ev.context} is beyond the model's context of {n_positions}"
            )
        if ev.context is None and ev.stride is not None and ev.stride > n_positions:
            problems.append(
                f"eval.stride: {ev.stride} is larger than the context (eval.context null = the "
                f"model's {n_positions})"
            )
    if ev.context is not None and ev.stride is not None and ev.stride > ev.context:
        problems.append(f"eval.stride: {ev.stride} is larger than eval.context {ev.context}")
    if s.runtime.backend == "nccl" and not may_use_gpu(s.runtime.device):
        problems.append(
            "runtime.backend: nccl needs runtime.device cuda (or auto); use gloo on cpu"
        )
    m = s.model
    if m.source in ("hub", "local") and not m.name:
        problems.append(f"model.name: required when model.source is {m.source}")
    if m.source == "init":
        problems += init_problems(m)
    if s.data.source == "local" and not s.data.local.train:
        problems.append("data.local.train: at least one file is required when data.source is local")
    return problems


def init_problems(m: ModelSettings) -> list[str]:
    """What model.init's keys make impossible together: its family's checks (distlm.family)."""
    return m.init.problems()


def known_model_args(s: Settings) -> ModelArgs | None:
    """What distlm's model of the config is built from, when known without the network: a
    seeded init's (of the vocabulary the tokenizer is asked for: the largest it can have), or a
    local folder's config.json; None for a hub model (its ranks check what it is)."""
    m = s.model
    if m.source == "init":
        spec = spec_of(m.init.architecture, where="model.init.architecture")
        doc = spec.init_doc(m.init, s.data.tokenizer.vocab_size, None)
        return model_args(doc, "model.init")
    if m.source == "local" and m.name and (Path(m.name) / "config.json").is_file():
        p = Path(m.name) / "config.json"
        try:
            return model_args(json.loads(p.read_text()), str(p))
        except (ValueError, OSError, DistlmError):
            return None  # known_architecture names what is wrong with it
    return None


def known_architecture(m: ModelSettings) -> tuple[int, int] | None:
    """(n_layer, n_positions) when known without the network: init config or a local folder's
    config.json, read by its family's config mapping (distlm.family: a model_type distlm does
    not support, or a key its model cannot run, is refused naming the file)."""
    if m.source == "init":
        return m.init.n_layer, m.init.n_positions
    if m.source == "local" and m.name:
        p = Path(m.name) / "config.json"
        if p.is_file():
            try:
                doc = json.loads(p.read_text())
            except (ValueError, OSError):
                raise ConfigError(f"model.name: {p} is not a readable model config") from None
            try:
                args = model_args(doc, str(p))
            except DistlmError as e:
                raise ConfigError(f"model.name: {e}") from None
            return args.n_layers, args.context
    return None
