"""Where the training stage reads and writes: `TrainPaths`, output names as distlm.dag.stages declares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distlm.dag.stages import STAGES

_STAGE = STAGES["train"]


@dataclass(frozen=True)
class TrainPaths:
    """Inputs and outputs of the training stage; output names as distlm.dag.stages declares them."""

    tokens: Path
    model: Path
    tokenizer: Path
    out: Path  # the stage folder, results/train

    @property
    def final(self) -> Path:
        return self.out / _STAGE.file("final")

    @property
    def metrics_csv(self) -> Path:
        return self.out / _STAGE.file("metrics")

    @property
    def val_csv(self) -> Path:
        return self.out / _STAGE.file("val")

    @property
    def tb(self) -> Path:
        return self.out / _STAGE.file("tb")

    @property
    def profile(self) -> Path:
        return self.out / _STAGE.file("profile")

    @property
    def checkpoints(self) -> Path:
        """The root of the run folders (one per run identity; distlm.train.checkpoint)."""
        return self.out / _STAGE.scratch["checkpoints"]

    @property
    def compile_cache(self) -> Path:
        """torch.compile's caches (inductor's, Triton's), kept with the stage's runs."""
        return self.out / _STAGE.scratch["compile_cache"]

    @property
    def serve_endpoint(self) -> Path:
        """Where a server that follows this run says it listens (distlm.train.pushes): the serve
        stage's folder beside this one."""
        serve = STAGES["serve"]
        return self.out.parent / serve.folder / serve.scratch["endpoint"]

    @property
    def lease(self) -> Path:
        """One trainer per stage folder at a time (distlm.runtime.lease)."""
        return self.checkpoints / "trainer.lease.json"
