"""The API server's supervisor: the listening socket, serve.api_servers HTTP processes on it
(distlm.inference.server.api_process) and the MPI job, from start to exit code.

    python -m distlm.entry.serve --launcher "mpiexec -n 2" --config results/config/serve.json \
        --model results/train/final

This process, outside the MPI job, listens on serve.host:port and hands the socket to the API
processes (the kernel gives each connection to one of them), makes a private folder for the
engine channels (messages.endpoints: its own, 0, and one per API process) and starts the pipeline
with the launcher. It serves no HTTP; on its own channel it hears stage 0's Ready, Health and
failures. Afterwards:
  * the job ends (a rank killed: the launcher ends every rank) -> the API processes answer 503
    to open requests and new ones, and this process exits with the job's exit code;
  * stage 0 reports a failure (a stage hangs) or stops sending Health -> the same, after the job
    is stopped;
  * an API process dies -> it is started again on its channel (stage 0 cancels what it had
    open); one that dies RESTARTS times within RESTART_WINDOW_S ends the server as a failure;
  * SIGTERM / SIGINT -> new requests get 503, Shutdown to stage 0, which stops the pipeline in
    order; exit code 0.
Stage 0 in turn stops when this process is gone, and so do the API processes (their stdin closes).

Connection limits are uvicorn's in each API process (limit_concurrency, keep-alive) plus a header
deadline, a header size limit and a lingering close (inference/server/transport.py's
GuardedHttpToolsProtocol). An idle connection costs a socket and a timer on the event loop, so the
limits are thousands (serve.max_connections) and the open-file limit is raised to its hard limit
at start (raise_nofile; the API processes inherit it); when a process is out of descriptors all
the same, EMFILE on accept is asyncio's: logged, accept resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distlm import DistlmError
from distlm.core.documents import read_document, write_document
from distlm.core.log import get_logger
from distlm.inference.messages import Control, endpoints, pipe_frame
from distlm.inference.server.api_process import ANSWER_S
from distlm.inference.server.client import EngineClient
from distlm.inference.server.metrics import MULTIPROC_ENV, Metrics
from distlm.inference.server.transport import raise_nofile
from distlm.settings import EngineSettings, ServeSettings
from distlm.transfer.documents import ServeEndpoint

log = get_logger(__name__)

_POLL_S = 0.05
RESTARTS = 5  # an API process that dies this often ...
RESTART_WINDOW_S = 60.0  # ... within this many seconds ends the server


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


class ApiProcesses:
    """The API server processes: started, told the supervisor's word, restarted when they die."""

    def __init__(self, count: int, cmd: list[str], sock: socket.socket, folder: Path) -> None:
        self.cmd, self.sock, self.folder = cmd, sock, folder
        self.metrics = folder / "metrics"  # prometheus_client's multiprocess folder
        self.metrics.mkdir()
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.starts = [0] * count
        self.deaths: list[list[float]] = [[] for _ in range(count)]

    def start(self, k: int) -> None:
        """API process k (channel k + 1), its start counted (its requests' numbers derive from it)."""
        self.starts[k] += 1
        args = [
            *self.cmd,
            "--channel",
            str(self.folder),
            "--index",
            str(k + 1),
            "--incarnation",
            str(self.starts[k]),
            "--fd",
            str(self.sock.fileno()),
        ]
        self.procs[k] = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            pass_fds=(self.sock.fileno(),),
            env={**os.environ, MULTIPROC_ENV: str(self.metrics)},
        )

    def check(self) -> str | None:
        """Restart the processes that died; why the server must end, when one dies too often."""
        from prometheus_client.multiprocess import mark_process_dead

        for k, proc in enumerate(self.procs):
            rc = None if proc is None else proc.poll()
            if proc is None or rc is None:
                continue
            mark_process_dead(proc.pid, str(self.metrics))  # its open sequences: none now
            now = time.monotonic()
            deaths = self.deaths[k] = [t for t in self.deaths[k] if now - t < RESTART_WINDOW_S]
            deaths.append(now)
            if len(deaths) >= RESTARTS:
                self.procs[k] = None
                return (
                    f"API server process {k + 1} (pid {proc.pid}) died {len(deaths)} times "
                    f"within {RESTART_WINDOW_S:g} s (last exit code {rc})"
                )
            log.error(
                "API server process %d (pid %d) died (exit code %d); starting it again",
                k + 1,
                proc.pid,
                rc,
            )
            self.start(k)
        return None

    def tell(self, msg: Control) -> None:
        """The supervisor's word to every live API process (one that cannot hear it is ending)."""
        frame = pipe_frame(msg)
        for proc in self.procs:
            if proc is not None and proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.write(frame)
                    proc.stdin.flush()

    async def end(self, timeout_s: float) -> None:
        """Wait for them to exit (after `failed`), then kill what is left."""
        deadline = time.monotonic() + timeout_s
        live = [p for p in self.procs if p is not None]
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        for p in live:
            if p.poll() is None:
                log.error("API server process pid %d did not exit; killing it", p.pid)
                p.kill()
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)


class Supervisor:
    """The API server and the pipeline job, from start to exit code."""

    def __init__(
        self,
        serve: ServeSettings,
        inference: EngineSettings,
        *,
        launch: list[str],
        engine_args: list[str],
        api_args: list[str],
        model_dir: Path,
        host: str,
        port: int,
        start_timeout_s: float,
        endpoint: Path | None = None,
    ) -> None:
        self.serve, self.inference = serve, inference
        self.endpoint = endpoint if serve.follow_training else None
        check_default_max_tokens(inference.max_new_tokens, serve.max_tokens)
        self.launch, self.engine_args = launch, engine_args
        self.api_args = api_args
        cores = os.cpu_count() or 1
        if serve.api_servers > cores:
            raise DistlmError(
                f"serve.api_servers: {serve.api_servers} API server processes on a host of "
                f"{cores} cores; at most {cores}"
            )
        self.model_dir = model_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = 2 * self.inference.timeout_s + 30
        read_token(serve)  # a bad token source stops the server before anything starts
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
            self._unannounce()
            self.sock.close()

    @property
    def url(self) -> str:
        """Where clients reach the server (an unspecified bind address: this host's name)."""
        host = self.address[0]
        if ipaddress.ip_address(host).is_unspecified:
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.address[1]}"

    def _announce(self) -> None:
        """serve.follow_training: say where this server listens, for the training run's pushes
        (distlm.train.pushes); the token's source, never the token."""
        if self.endpoint is None:
            return
        doc = ServeEndpoint(
            url=self.url,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            token_env=self.serve.token_env,
            token_file=str(Path(self.serve.token_file).resolve())
            if self.serve.token_file
            else None,
        )
        self.endpoint.parent.mkdir(parents=True, exist_ok=True)
        write_document(self.endpoint, doc)
        log.info("following the training run: its checkpoints are pushed here (%s)", self.endpoint)

    def _unannounce(self) -> None:
        """The endpoint document goes with the server (when it is still this server's)."""
        if self.endpoint is None:
            return
        with contextlib.suppress(OSError, DistlmError):
            if read_document(self.endpoint, ServeEndpoint).pid == os.getpid():
                self.endpoint.unlink()

    async def _main(self, tmp: Path) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signalled, sig)
        # the supervisor's own channel (0): Ready, Health and failures; it submits nothing
        engine = EngineClient(endpoints(str(tmp), 0), Metrics())
        engine.start()
        self.api = ApiProcesses(self.serve.api_servers, self.api_args, self.sock, tmp)
        for k in range(self.serve.api_servers):
            self.api.start(k)
        cmd = [
            *self.launch,
            *self.engine_args,
            "--channel",
            str(tmp),
            "--api-servers",
            str(self.serve.api_servers),
            "--api-pid",
            str(os.getpid()),
        ]
        log.info(
            "listening on http://%s:%d with %d API server processes; starting the pipeline: %s",
            *self.address,
            self.serve.api_servers,
            shlex.join(cmd),
        )
        self._announce()
        # its own session: a Ctrl-C at the terminal reaches this process only, which stops the
        # job in order
        self.child = await asyncio.to_thread(subprocess.Popen, cmd, start_new_session=True)
        try:
            rc = await self._supervise(engine)
        finally:
            if self.child.poll() is None:
                await self._kill_job()
            if engine.failed is None:
                reason = self.stop_reason or "the server is shutting down"
                engine.fail(reason, error=False)
                self.api.tell(Control(state="failed", reason=reason, error=False))
            await self.api.end(ANSWER_S + 10)
            await engine.close()
        return rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as a shell says

    def _signalled(self, sig: int) -> None:
        log.info("%s: stopping", signal.Signals(sig).name)
        self.stop_reason = "the server is shutting down"

    async def _supervise(self, engine: EngineClient) -> int:
        child = self._job()
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
            died = self.api.check()
            if died is not None:
                await self._kill_job()
                return self._failed(engine, 1, died)
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
            died = self.api.check()
            if died is not None:
                await self._kill_job()
                return self._failed(engine, 1, died)
            if time.monotonic() - engine.health_at > silent_s:
                reason = f"stage 0 sent nothing for {silent_s:g} s: it hangs"
                engine.fail(reason)
                await self._kill_job()
                return self._failed(engine, 1, reason)
            await asyncio.sleep(_POLL_S)
        self.api.tell(Control(state="stopping", reason=self.stop_reason))
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
        self.api.tell(Control(state="failed", reason=reason))
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
    endpoint: str | Path | None = None,
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
        api_args=[
            sys.executable,
            "-m",
            module,
            "--api",
            "--config",
            str(config),
            "--model",
            str(model_dir),
        ],
        model_dir=Path(model_dir),
        host=serve.host if host is None else host,
        port=serve.port if port is None else port,
        start_timeout_s=start_timeout_s,
        endpoint=None if endpoint is None else Path(endpoint),
    )
    return sup.run()
