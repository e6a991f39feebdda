"""The access log: one escaped line per request, and the requests-by-status counter (ASGI)."""

from __future__ import annotations

import re
import time

from distlm.core.log import get_logger
from distlm.inference.server.metrics import Metrics

access = get_logger("distlm.inference.access")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")


def escape(text: str) -> str:
    """Control characters (and backslashes) as escapes: a request cannot write to the terminal."""
    return _CONTROL.sub(
        lambda m: (
            m.group().encode("unicode_escape").decode("ascii") if m.group() != "\\" else "\\\\"
        ),
        text,
    )


class AccessLog:
    """ASGI middleware: one line per request (client, method, path, status, timings), escaped;
    and the requests-by-status counter."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        info = scope.setdefault("distlm", {})
        status = {"code": 0}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            code = status["code"] or 499
            path = scope.get("path", "")
            route = (
                path
                if path
                in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
                else "other"
            )
            m = self.metrics
            m.count(m.child(m.requests, route, str(code)))
            client = scope.get("client") or ("-", 0)
            extra = "".join(
                f" {k}={v:.4f}" if isinstance(v, float) else f" {k}={v}" for k, v in info.items()
            )
            access.info(
                "%s:%s %s %s %d %.4fs%s",
                client[0],
                client[1],
                escape(scope.get("method", "")),
                escape(path),
                code,
                time.perf_counter() - t0,
                escape(extra),
            )
