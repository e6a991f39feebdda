"""The API server process: uvicorn serving `distlm.inference.server.app`, and the MPI job it
supervises.

    python -m distlm.entry.serve --launcher "mpiexec -n 2" --config results/config/serve.json \
        --model results/train/final

One process outside the MPI job listens on serve.host:port, binds the engine channel (two IPC
sockets in a private temporary folder), and starts the pipeline with the launcher; stage 0 connects
and sends Ready. Until then requests get 503 ("starting"). Afterwards:
  * the job ends (a rank killed: the launcher ends every rank) -> open requests and new ones get
    503, and this process exits with the job's exit code;
  * stage 0 reports a failure (a stage hangs) or stops sending Health -> the same, after the job
    is stopped;
  * SIGTERM / SIGINT -> Shutdown to stage 0, which stops the pipeline in order; exit code 0.
Stage 0 in turn stops when this process is gone.

Connection limits are uvicorn's (limit_concurrency, keep-alive, h11's header size) plus a header
deadline and a lingering close (inference/server/transport.py's GuardedH11Protocol). An idle connection costs a socket
and a timer on the event loop, so the limits are thousands (serve.max_connections) and the
open-file limit is raised to its hard limit at start (raise_nofile); when the process is out of
descriptors all the same, EMFILE on accept is asyncio's: logged, accept resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvicorn

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.inference.server.access_log import AccessLog
from distlm.inference.server.app import build_app
from distlm.inference.server.client import EngineClient
from distlm.inference.server.metrics import Metrics
from distlm.inference.server.state import ServeState
from distlm.inference.server.transport import GuardedH11Protocol, raise_nofile
from distlm.runtime.heap import freeze_startup_heap
from distlm.settings import EngineSettings, ServeSettings

log = get_logger(__name__)

_ANSWER_S = 5.0  # after the job ended: how long open requests get to receive their 503
_POLL_S = 0.05


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the supervisor decides how to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def check_default_max_tokens(max_new_tokens: int, limit: int) -> None:
    """A request without max_tokens gets inference.max_new_tokens: it must be within the server's
    limit, else every such request would be refused."""
    if max_new_tokens > limit:
        raise DistlmError(
            f"inference.max_new_tokens: {max_new_tokens}, the default max_tokens of a request, is "
            f"above serve.max_tokens ({limit}), the most a request may ask for: lower it or "
            "raise serve.max_tokens"
        )


def read_token(serve: ServeSettings) -> str | None:
    """The bearer token from serve.token_env and/or serve.token_file; None when neither is set."""
    tokens = []
    if serve.token_env:
        value = os.environ.get(serve.token_env, "")
        if not value.strip():
            raise DistlmError(
                f"serve.token_env: environment variable {serve.token_env} is not set or empty"
            )
        tokens.append(value.strip())
    if serve.token_file:
        try:
            value = Path(serve.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise DistlmError(f"serve.token_file: cannot read {serve.token_file} ({e})") from None
        if not value:
            raise DistlmError(f"serve.token_file: {serve.token_file} is empty")
        tokens.append(value)
    if len(set(tokens)) > 1:
        raise DistlmError("serve.token_env and serve.token_file hold different tokens")
    return tokens[0] if tokens else None


def _setup_server_logs() -> None:
    """uvicorn's and asyncio's messages (accept errors such as EMFILE) through distlm's handlers."""
    import logging

    handlers = logging.getLogger("distlm").handlers
    for name in ("uvicorn", "uvicorn.error", "asyncio"):
        lg = logging.getLogger(name)
        lg.handlers = list(handlers)
        lg.propagate = False
        lg.setLevel(logging.INFO)


class Supervisor:
    """The API server and the pipeline job, from start to exit code."""

    def __init__(
        self,
        serve: ServeSettings,
        inference: EngineSettings,
        *,
        launch: list[str],
        engine_args: list[str],
        model_dir: Path,
        host: str,
        port: int,
        start_timeout_s: float,
    ) -> None:
        self.serve, self.inference = serve, inference
        check_default_max_tokens(inference.max_new_tokens, serve.max_tokens)
        self.launch, self.engine_args = launch, engine_args
        self.model_dir = model_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = 2 * self.inference.timeout_s + 30
        self.token = read_token(serve)
        before, now = raise_nofile()
        log.info(
            "open-file limit %d (was %d); serve.max_connections %d",
            now,
            before,
            self.serve.max_connections,
        )
        try:
            self.sock = socket.create_server((host, port), backlog=self.serve.backlog)
        except OSError as e:
            raise DistlmError(
                f"serve: cannot listen on {host}:{port} (serve.host/port): {e}"
            ) from None
        self.address = self.sock.getsockname()[:2]
        self.stop_reason: str | None = None
        self.child: subprocess.Popen | None = None

    def run(self) -> int:
        try:
            with tempfile.TemporaryDirectory(prefix="distlm-serve-") as tmp:
                return asyncio.run(self._main(Path(tmp)))
        finally:
            self.sock.close()

    async def _main(self, tmp: Path) -> int:
        from distlm.data import load_tokenizer

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signalled, sig)
        metrics = Metrics()
        engine = EngineClient(f"ipc://{tmp}/requests", f"ipc://{tmp}/events", metrics)
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
        GuardedH11Protocol.header_timeout_s = self.serve.header_timeout_s
        GuardedH11Protocol.linger_s = self.serve.linger_s
        GuardedH11Protocol.linger_bytes = self.serve.linger_bytes
        config = uvicorn.Config(
            AccessLog(build_app(st), metrics),
            http=GuardedH11Protocol,
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            limit_concurrency=self.serve.max_connections,
            timeout_keep_alive=self.serve.keep_alive_timeout_s,
            h11_max_incomplete_event_size=self.serve.max_header_bytes,
            backlog=self.serve.backlog,
        )
        _setup_server_logs()
        server = _Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[self.sock]))
        cmd = [
            *self.launch,
            *self.engine_args,
            "--requests",
            f"ipc://{tmp}/requests",
            "--events",
            f"ipc://{tmp}/events",
            "--api-pid",
            str(os.getpid()),
        ]
        log.info(
            "API server on http://%s:%d; starting the pipeline: %s", *self.address, shlex.join(cmd)
        )
        # its own session: a Ctrl-C at the terminal reaches this process only, which stops the
        # job in order
        self.child = await asyncio.to_thread(subprocess.Popen, cmd, start_new_session=True)
        try:
            rc = await self._supervise(st)
        finally:
            if self.child.poll() is None:
                await self._kill_job()
            st.state = "stopping" if st.engine.failed is None else "failed"
            if not st.engine.failed:
                engine.fail(self.stop_reason or "the server is shutting down", error=False)
            await self._wait_answered(engine)
            server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(serving, timeout=_ANSWER_S + 5)
            await engine.close()
        return rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as a shell says

    def _signalled(self, sig: int) -> None:
        log.info("%s: stopping", signal.Signals(sig).name)
        self.stop_reason = "the server is shutting down"

    async def _supervise(self, st: ServeState) -> int:
        engine, child = st.engine, self._job()
        deadline = time.monotonic() + self.start_timeout_s
        while engine.ready is None:
            if self.stop_reason:
                return await self._kill_job()
            rc = child.poll()
            if rc is not None:
                return self._failed(
                    engine, rc, f"the pipeline job exited with code {rc} before it was ready"
                )
            if engine.failed:
                return self._failed(engine, await self._job_end(), engine.failed)
            if time.monotonic() > deadline:
                await self._kill_job()
                return self._failed(
                    engine, 1, f"the pipeline was not ready within {self.start_timeout_s:g} s"
                )
            await asyncio.sleep(_POLL_S)
        here = socket.gethostname()
        if engine.ready.hostname != here:
            await self._kill_job()
            raise DistlmError(
                f"serve: stage 0 runs on {engine.ready.hostname}, the API server on "
                f"{here}; the engine channel is IPC, so rank 0 must run on this host "
                "(the launcher's first host)"
            )
        st.state = "ready"
        log.info(
            "pipeline ready: stage 0 (pid %d), %d stages, %d lanes; serving on http://%s:%d",
            engine.ready.pid,
            engine.ready.stages,
            engine.ready.lanes,
            *self.address,
        )
        silent_s = max(10.0, self.inference.timeout_s)
        while not self.stop_reason:
            rc = child.poll()
            if rc is not None:
                return self._failed(engine, rc, f"the pipeline job ended (exit code {rc})")
            if engine.failed:
                return self._failed(engine, await self._job_end(), engine.failed)
            if time.monotonic() - engine.health_at > silent_s:
                reason = f"stage 0 sent nothing for {silent_s:g} s: it hangs"
                engine.fail(reason)
                await self._kill_job()
                return self._failed(engine, 1, reason)
            await asyncio.sleep(_POLL_S)
        st.state = "stopping"
        log.info("asking stage 0 (pid %d) to stop the pipeline", engine.ready.pid)
        engine.shutdown(self.stop_reason)
        try:
            rc = await self._wait_child(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.error("the pipeline did not stop within %g s; killing it", self.stop_timeout_s)
            rc = await self._kill_job()
        log.info("pipeline stopped (exit code %d)", rc)
        return rc

    async def _job_end(self) -> int:
        """After stage 0 reported a failure: the job's exit code (killed if it lingers)."""
        try:
            return await self._wait_child(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            return await self._kill_job() or 1

    def _failed(self, engine: EngineClient, rc: int, reason: str) -> int:
        engine.fail(reason)
        log.error("%s; answering 503", reason)
        return rc or 1

    def _job(self) -> subprocess.Popen:
        """The MPI job's launcher process (started by _main before anything waits on it)."""
        if self.child is None:
            raise DistlmError("serve: the pipeline job was not started")
        return self.child

    async def _wait_child(self, timeout_s: float) -> int:
        child = self._job()
        deadline = time.monotonic() + timeout_s
        while child.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(child.args, timeout_s)
            await asyncio.sleep(_POLL_S)
        return child.returncode

    async def _kill_job(self) -> int:
        """End the job through its launcher (SIGTERM: mpiexec and srun end every rank); then
        SIGKILL to its process group."""
        child = self._job()
        with contextlib.suppress(ProcessLookupError):
            child.terminate()
        try:
            return await self._wait_child(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            return await self._wait_child(10)

    async def _wait_answered(self, engine: EngineClient) -> None:
        deadline = time.monotonic() + _ANSWER_S
        while engine.queues and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if engine.queues:
            log.error("%d requests still open after %g s; closing", len(engine.queues), _ANSWER_S)


def run_api_server(
    serve: ServeSettings,
    inference: EngineSettings,
    *,
    launcher: str,
    module: str,
    config: str | Path,
    model_dir: str | Path,
    host: str | None = None,
    port: int | None = None,
    start_timeout_s: float = 900.0,
) -> int:
    """Serve mode: returns the exit code (the pipeline job's; 0 after a requested stop)."""
    launch = shlex.split(launcher)
    if not launch:
        raise DistlmError(
            "serve: --launcher is empty (the serve rule passes the profile's `mpi` resource)"
        )
    sup = Supervisor(
        serve,
        inference,
        launch=launch,
        engine_args=[
            sys.executable,
            "-m",
            module,
            "--engine",
            "--config",
            str(config),
            "--model",
            str(model_dir),
        ],
        model_dir=Path(model_dir),
        host=serve.host if host is None else host,
        port=serve.port if port is None else port,
        start_timeout_s=start_timeout_s,
    )
    return sup.run()
