"""One API server process: uvicorn serving the app on the supervisor's listening socket, with a
channel of its own to stage 0 and the supervisor's word on its stdin.

    python -m distlm.entry.serve --api --config results/config/serve.json \
        --model results/train/final --channel FOLDER --index K --incarnation G --fd F

The supervisor (distlm.inference.server.supervisor) starts serve.api_servers of these, nobody else
needs to. Each one holds the whole API: the token, the limits, /health, its requests' streams;
/metrics sums over all of them (metrics.exposition). It is "starting" (503) until stage 0 answers
its Attach with Ready. Its stdin is a pipe from the supervisor carrying Control messages:
`stopping` (new requests get 503), `failed` (every open and new request gets 503 with the reason,
then the process exits once they are answered, at most _ANSWER_S later). The pipe's end means the
supervisor is gone: the same as `failed`, so no API process outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn

from distlm.core.log import get_logger
from distlm.inference.messages import Control, endpoints, read_pipe_frame
from distlm.inference.server.access_log import AccessLog
from distlm.inference.server.app import build_app
from distlm.inference.server.client import EngineClient
from distlm.inference.server.metrics import Metrics
from distlm.inference.server.state import ServeState
from distlm.inference.server.transport import GuardedHttpToolsProtocol
from distlm.runtime.heap import freeze_startup_heap
from distlm.settings import EngineSettings, ServeSettings

log = get_logger(__name__)

ANSWER_S = 5.0  # after a failure or a stop: how long open requests get to receive their 503
_POLL_S = 0.05
RID_BITS = 40  # a start's requests are numbered from incarnation << RID_BITS


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the supervisor decides how to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _setup_server_logs() -> None:
    """uvicorn's and asyncio's messages (accept errors such as EMFILE) through distlm's handlers."""
    import logging

    handlers = logging.getLogger("distlm").handlers
    for name in ("uvicorn", "uvicorn.error", "asyncio"):
        lg = logging.getLogger(name)
        lg.handlers = list(handlers)
        lg.propagate = False
        lg.setLevel(logging.INFO)


class ApiProcess:
    """One HTTP process, from its start to its exit."""

    def __init__(
        self,
        serve: ServeSettings,
        inference: EngineSettings,
        *,
        model_dir: Path,
        channel: str,
        index: int,
        incarnation: int,
        fd: int,
        token: str | None,
    ) -> None:
        self.serve, self.inference = serve, inference
        self.model_dir = model_dir
        self.channel, self.index, self.incarnation = channel, index, incarnation
        self.sock = socket.socket(fileno=fd)
        self.token = token

    def run(self) -> int:
        # Ctrl-C at the terminal reaches the whole process group: the supervisor acts on it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return asyncio.run(self._main())
        finally:
            self.sock.close()

    async def _main(self) -> int:
        from distlm.data import load_tokenizer

        metrics = Metrics()
        engine = EngineClient(
            endpoints(self.channel, self.index),
            metrics,
            rid_base=self.incarnation << RID_BITS,
        )
        engine.start()
        st = ServeState.build(
            self.serve,
            self.inference,
            model_id=self.model_dir.resolve().name,
            tokenizer=load_tokenizer(self.model_dir),
            engine=engine,
            metrics=metrics,
            token=self.token,
        )
        freeze_startup_heap("API server")  # the tokenizer and the app built: before requests
        GuardedHttpToolsProtocol.header_timeout_s = self.serve.header_timeout_s
        GuardedHttpToolsProtocol.linger_s = self.serve.linger_s
        GuardedHttpToolsProtocol.linger_bytes = self.serve.linger_bytes
        GuardedHttpToolsProtocol.max_header_bytes = self.serve.max_header_bytes
        config = uvicorn.Config(
            AccessLog(build_app(st), metrics),
            http=GuardedHttpToolsProtocol,
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            limit_concurrency=self.serve.max_connections,
            timeout_keep_alive=self.serve.keep_alive_timeout_s,
            backlog=self.serve.backlog,
        )
        _setup_server_logs()
        obey = asyncio.ensure_future(self._obey(st))
        ready = asyncio.ensure_future(self._ready(st))
        if self.incarnation > 1:
            # started again while the pipeline serves: take connections once stage 0 answers
            # this channel, not answer them 503 meanwhile (at the first start, "starting" is
            # the truth: the pipeline itself is starting)
            await asyncio.wait([obey, ready], return_when=asyncio.FIRST_COMPLETED)
        server = _Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[self.sock]))
        try:
            await obey
            await self._wait_answered(engine)
        finally:
            ready.cancel()
            server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(serving, timeout=ANSWER_S + 5)
            await engine.close()
        return 0

    async def _ready(self, st: ServeState) -> None:
        await st.engine.ready_event.wait()
        if st.state == "starting":
            st.state = "ready"
            log.info(
                "API server process %d (start %d) serving: stage 0 answered its channel",
                self.index,
                self.incarnation,
            )

    async def _obey(self, st: ServeState) -> None:
        """The supervisor's word, until it says the server failed or stops, or is gone."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
        while True:
            msg = await read_pipe_frame(reader)
            if msg is None:
                st.state = "failed"
                st.engine.fail("the API server's supervisor is gone")
                return
            if not isinstance(msg, Control):
                log.error("supervisor pipe: unexpected %s (ignored)", type(msg).__name__)
                continue
            if msg.state == "stopping":
                if st.state in ("starting", "ready"):
                    st.state = "stopping"
                continue
            st.state = "failed" if msg.error else "stopping"
            st.engine.fail(msg.reason, error=msg.error)
            return

    async def _wait_answered(self, engine: EngineClient) -> None:
        deadline = time.monotonic() + ANSWER_S
        while engine.queues and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if engine.queues:
            log.error("%d requests still open after %g s; closing", len(engine.queues), ANSWER_S)
