"""The inference stage's documents: the per-token timing of a run (`InferenceTiming`) and a sweep's
(`InferenceSweep`)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from distlm.core.documents import Document, Part

# ----------------------------------------------------------------------------- inference


class Ttft(Part):
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
    per_stage: list[dict] = Field(default_factory=list)
    hosts: list[dict] = Field(default_factory=list)
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
