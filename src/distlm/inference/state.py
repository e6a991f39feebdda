"""What the API server's routes share: settings, the tokenizer, the engine client, the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distlm.inference.client import EngineClient
from distlm.inference.metrics import Metrics
from distlm.settings import EngineSettings, ServeSettings


@dataclass
class ServeState:
    """What the routes need: settings, the tokenizer, the engine client, the metrics."""

    serve: ServeSettings
    inference: EngineSettings
    model_id: str
    tokenizer: Any  # a transformers tokenizer
    engine: EngineClient
    metrics: Metrics
    token: str | None = None
    state: str = "starting"  # starting -> ready -> stopping | failed

    def unavailable(self) -> str | None:
        """Why requests get a 503 now, or None when the pipeline serves."""
        if self.engine.failed is not None:
            return self.engine.failed
        if self.state == "starting":
            return "the pipeline is starting"
        if self.state == "stopping":
            return "the server is shutting down"
        return None
