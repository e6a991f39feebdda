"""The HTTP front of serve mode: a process outside the MPI job, so clients get 503 when the job dies.

    python workflow/scripts/serve.py --launcher "mpiexec -n 3" --config results/config/inference.json \
        --model results/train/final

MPI launchers end every rank when one is killed (mpich's hydra sends SIGKILL to the rest even with
-disable-auto-cleanup; srun ends the step), so a server inside the job dies with it and its clients
see a dropped connection. The front binds the public address (inference.serve.host/port), starts the
pipeline job through the launcher with stage 0's server on 127.0.0.1 and a free port, and relays
each connection to it byte for byte: every request check, the token and the limits stay in stage 0
(`distlm.inference.server`). When stage 0 goes away before a response is complete, the front
finishes it: a 503 with an OpenAI-style JSON error if nothing was sent yet, an error event if a
stream was under way. Requests while the job starts, after it failed, or while stopping get 503
(`/health` says which). The front exits with the job's exit code (non-zero when it failed); SIGINT
or SIGTERM stop stage 0 gracefully (it finishes the ring and stops the other stages).

Stage 0 must run on the front's host (it listens on 127.0.0.1): `mpiexec` puts rank 0 on the first
host, and so does `srun` inside a SLURM job, whose batch script runs on the allocation's first node.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from distlm import DistlmError
from distlm.io import read_json
from distlm.log import get_logger

log = get_logger(__name__)

_HEAD_LIMIT = 64 << 10  # a request head larger than this is not read further (the front answers 503 only)
_DRAIN_LIMIT = 16 << 20  # at most this much of a request body is read before answering it ourselves
_ANSWER_S = 5.0  # after the job ended: how long open connections get to receive their answers
_EXIT_WAIT_S = 2.0  # how long a cut connection waits for the job's exit code, to name it


def _json_response(status: int, reason: str, obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    head = (
        f"HTTP/1.0 {status} {reason}\r\nServer: distlm-front\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _error_doc(message: str) -> dict:
    return {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}


def unavailable(message: str, status_doc: dict | None = None) -> bytes:
    """A complete 503 response: an OpenAI-style error, or `status_doc` (for /health)."""
    return _json_response(503, "Service Unavailable", status_doc or _error_doc(message))


def stream_error(message: str) -> bytes:
    """The server-sent event that ends a stream the pipeline could not finish (as stage 0 writes it)."""
    return f"data: {json.dumps(_error_doc(message))}\n\n".encode()


class OpenCount:
    """Requests or connections not yet answered, so a process can wait for them before it ends."""

    def __init__(self) -> None:
        self.n = 0
        self._cv = threading.Condition()

    def opened(self) -> None:
        with self._cv:
            self.n += 1

    def closed(self) -> None:
        with self._cv:
            self.n -= 1
            self._cv.notify_all()

    def __enter__(self) -> None:
        self.opened()

    def __exit__(self, *exc) -> None:
        self.closed()

    def wait_answered(self, timeout_s: float, each=None) -> int:
        """Wait until none is open, at most timeout_s (calling `each()` before every look); how many still are."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                if each is not None:
                    each()
                if not self.n or time.monotonic() > deadline:
                    return self.n
                self._cv.wait(timeout=0.05)


class ResponseWatch:
    """Follows a relayed HTTP/1.0 response to tell a complete one from one cut short.

    Complete: the body has Content-Length bytes; a server-sent event stream ends with `[DONE]` or an
    error event; a response with neither is complete when it ends (HTTP/1.0 close-delimited).
    """

    def __init__(self) -> None:
        self.head = b""
        self.head_done = False
        self.sent = 0  # bytes of the response passed on to the client
        self.length: int | None = None
        self.body = 0
        self.sse = False
        self.tail = b""

    def feed(self, data: bytes) -> None:
        self.sent += len(data)
        if not self.head_done:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_done = True
            rest = self.head[end + 4:]
            self._parse(self.head[:end].decode("latin-1"))
            data = rest
        self.body += len(data)
        self.tail = (self.tail + data)[-4096:]

    def _parse(self, head: str) -> None:
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length" and value.isdigit():
                self.length = int(value)
            elif name == "content-type" and value.startswith("text/event-stream"):
                self.sse = True

    def complete(self) -> bool:
        if not self.head_done:
            return False
        if self.length is not None:
            return self.body >= self.length
        if self.sse:
            events = [e for e in self.tail.split(b"\n\n") if e.strip()]
            last = events[-1] if events and self.tail.endswith(b"\n\n") else b""
            return last == b"data: [DONE]" or last.startswith(b'data: {"error"')
        return True


class Front:
    """Public listener, the pipeline job as a child process, and a relay per connection."""

    def __init__(self, launch: list[str], backend_args: list[str], *, host: str, port: int,
                 start_timeout_s: float, stop_timeout_s: float) -> None:
        self.launch = launch
        self.backend_args = backend_args
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.state = "starting"  # -> ready -> stopping | failed
        self.reason = "the pipeline is starting"
        self.backend: tuple[str, int] | None = None
        self.stage0_pid: int | None = None
        self.child: subprocess.Popen | None = None
        self.stop = threading.Event()
        self.open = OpenCount()  # client connections not yet closed
        try:
            self.listener = socket.create_server((host, port), backlog=128)
        except OSError as e:
            raise DistlmError(
                f"serve: cannot listen on {host}:{port} (inference.serve.host/port): {e}"
            ) from None
        self.address = self.listener.getsockname()[:2]

    # ------------------------------------------------------------------ the job

    def run(self) -> int:
        """Start the job, serve until it ends or a signal stops it; the exit code for this process."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        threading.Thread(target=self._accept_loop, name="front-accept", daemon=True).start()
        with tempfile.TemporaryDirectory(prefix="distlm-serve-") as tmp:
            ready = Path(tmp) / "stage0.json"
            cmd = [*self.launch, *self.backend_args, "--host", "127.0.0.1", "--port", "0",
                   "--ready-file", str(ready), "--front-pid", str(os.getpid())]
            log.info("front on http://%s:%d; starting the pipeline: %s", *self.address, shlex.join(cmd))
            # its own session: a Ctrl-C at the terminal reaches the front only, which stops the job in order
            self.child = subprocess.Popen(cmd, start_new_session=True)
            try:
                rc = self._supervise(ready)
            finally:
                if self.child.poll() is None:
                    self._kill_job()
        self.listener.close()
        return rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as a shell says

    def _supervise(self, ready: Path) -> int:
        deadline = time.monotonic() + self.start_timeout_s
        while self.state == "starting":
            if self.stop.is_set():
                return self._stop()
            rc = self.child.poll()
            if rc is not None:
                return self._failed(rc, f"the pipeline job exited with code {rc} before it was ready")
            if ready.exists():
                self._ready(read_json(ready, "stage 0's ready file"))
            elif time.monotonic() > deadline:
                self._kill_job()
                return self._failed(1, f"the pipeline was not ready within {self.start_timeout_s:g} s")
            else:
                time.sleep(0.05)
        while not self.stop.is_set():
            rc = self.child.poll()
            if rc is not None and not self.stop.is_set():  # (a stop signal may have reached both)
                return self._failed(rc, f"the pipeline job ended (exit code {rc})")
            time.sleep(0.05)
        return self._stop()

    def _ready(self, info: dict) -> None:
        here = socket.gethostname()
        if info["hostname"] != here:
            self._kill_job()
            raise DistlmError(
                f"serve: stage 0 runs on {info['hostname']}, the front on {here}; stage 0 listens on "
                "127.0.0.1, so rank 0 must run on the front's host (the launcher's first host)"
            )
        self.backend = (info["host"], info["port"])
        self.stage0_pid = info["pid"]
        self.state = "ready"
        log.info("pipeline ready: stage 0 (pid %d) answers on %s:%d; serving on http://%s:%d",
                 info["pid"], *self.backend, *self.address)

    def _failed(self, rc: int, reason: str) -> int:
        self.reason = reason
        self.state = "failed"
        log.error("%s; answering 503", reason)
        self._wait_answered()
        return rc or 1

    def _stop(self) -> int:
        self.state = "stopping"
        self.reason = "the server is shutting down"
        if self.stage0_pid is not None:
            log.info("stopping: asking stage 0 (pid %d) to stop the pipeline", self.stage0_pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.stage0_pid, signal.SIGINT)
        else:
            self._kill_job()
        try:
            rc = self.child.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.error("the pipeline did not stop within %g s; killing it", self.stop_timeout_s)
            self._kill_job()
            rc = self.child.wait()
        self._wait_answered()
        log.info("pipeline stopped (exit code %d)", rc)
        return rc

    def _kill_job(self) -> None:
        """End the job through its launcher (SIGTERM: mpiexec and srun then end every rank); SIGKILL late."""
        with contextlib.suppress(ProcessLookupError):
            self.child.terminate()
        try:
            self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGKILL)

    def _wait_answered(self) -> None:
        left = self.open.wait_answered(_ANSWER_S)
        if left:
            log.error("%d connections still open after %g s; closing", left, _ANSWER_S)

    def _job_reason(self) -> str:
        """Why stage 0 went away, naming the job's exit code when it ends soon."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = self.child.wait(timeout=_EXIT_WAIT_S)
            return f"the pipeline job ended (exit code {rc}) before answering: a stage died"
        return "stage 0 closed the connection before answering"

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.open.opened()
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        try:
            if self.state == "ready":
                self._relay(client)
            else:
                self._answer(client, self.reason)
        except OSError as e:  # the client went away
            log.debug("connection ended: %s", e)
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()
            self.open.closed()

    def _answer(self, client: socket.socket, reason: str) -> None:
        """Read the request (so the client is not reset) and answer 503 ourselves."""
        client.settimeout(5.0)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
            data = client.recv(65536)
            if not data:
                return
            head += data
        end = head.find(b"\r\n\r\n")
        lines = head[:end].decode("latin-1").split("\r\n") if end >= 0 else [""]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length" and value.strip().isdigit():
                length = int(value.strip())
        left = min(length, _DRAIN_LIMIT) - (len(head) - end - 4 if end >= 0 else 0)
        while left > 0:
            data = client.recv(min(65536, left))
            if not data:
                break
            left -= len(data)
        path = lines[0].split(" ")[1].split("?", 1)[0] if len(lines[0].split(" ")) > 1 else ""
        health = {"status": {"starting": "starting", "stopping": "stopping"}.get(self.state, "unavailable"),
                  "error": reason} if path == "/health" else None
        client.sendall(unavailable(f"the pipeline is unavailable: {reason}", health))

    def _relay(self, client: socket.socket) -> None:
        try:
            backend = socket.create_connection(self.backend, timeout=5.0)
        except OSError as e:
            self._answer(client, f"cannot reach stage 0 ({e})")
            return
        backend.settimeout(None)
        watch = ResponseWatch()
        up = threading.Thread(target=_pump, args=(client, backend), name="front-up", daemon=True)
        up.start()
        try:
            while True:
                try:
                    data = backend.recv(65536)
                except OSError:
                    data = b""  # reset by a dying stage 0
                if not data:
                    break
                watch.feed(data)
                client.sendall(data)
        finally:
            with contextlib.suppress(OSError):
                backend.shutdown(socket.SHUT_RDWR)
            backend.close()
        if watch.complete():
            return
        reason = self._job_reason()
        log.error("a response was cut short (%d bytes sent): %s; answering 503", watch.sent, reason)
        message = f"the pipeline is unavailable: {reason}"
        if watch.sent == 0:
            client.sendall(unavailable(message))
        elif watch.sse and watch.head_done:
            client.sendall(stream_error(message))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Client to stage 0, until the client stops sending; then half-close towards stage 0."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def run_front(icfg: dict, *, launcher: str, script: str | Path, config: str | Path, model_dir: str | Path,
              host: str | None = None, port: int | None = None, start_timeout_s: float = 900.0) -> int:
    """Serve mode with a front: returns the exit code (the pipeline job's; 0 after a requested stop)."""
    launch = shlex.split(launcher)
    if not launch:
        raise DistlmError("serve: --launcher is empty (the serve rule passes the profile's `mpi` resource)")
    scfg = icfg["serve"]
    front = Front(
        launch, [sys.executable, str(script), "--config", str(config), "--model", str(model_dir)],
        host=scfg["host"] if host is None else host, port=scfg["port"] if port is None else port,
        start_timeout_s=start_timeout_s, stop_timeout_s=2 * icfg["timeout_s"] + 30,
    )
    return front.run()
