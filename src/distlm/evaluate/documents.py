"""The evaluation stage's report (results/eval/<model>.json: `EvalReport`)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from distlm.core.documents import Document

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
