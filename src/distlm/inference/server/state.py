"""What the API server's routes hold, split by what each part needs: the routes themselves (the
bearer token, whether the pipeline serves, the body limits, /health and /metrics), making a
request ready (`prepare.Preparing`) and answering it (`answer.Answering`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distlm.inference.server.answer import Answering
from distlm.inference.server.client import EngineClient
from distlm.inference.server.metrics import Metrics
from distlm.inference.server.prepare import Preparing
from distlm.settings import EngineSettings, ServeSettings


@dataclass
class ServeState:
    """What the routes need; `preparing` and `answering` are handed to the request's two steps."""

    serve: ServeSettings
    model_id: str
    engine: EngineClient
    metrics: Metrics
    preparing: Preparing
    answering: Answering
    token: str | None = None
    state: str = "starting"  # starting -> ready -> stopping | failed

    @classmethod
    def build(
        cls,
        serve: ServeSettings,
        inference: EngineSettings,
        *,
        model_id: str,
        tokenizer: Any,  # a transformers tokenizer
        engine: EngineClient,
        metrics: Metrics,
        token: str | None = None,
    ) -> ServeState:
        return cls(
            serve,
            model_id,
            engine,
            metrics,
            preparing=Preparing(serve, inference, tokenizer, ready=lambda: engine.ready),
            answering=Answering.of(
                serve,
                inference,
                engine=engine,
                model_id=model_id,
                tokenizer=tokenizer,
                metrics=metrics,
            ),
            token=token,
        )

    def unavailable(self) -> str | None:
        """Why requests get a 503 now, or None when the pipeline serves."""
        if self.engine.failed is not None:
            return self.engine.failed
        if self.state == "starting":
            return "the pipeline is starting"
        if self.state == "stopping":
            return "the server is shutting down"
        return None
