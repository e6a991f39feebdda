"""Serve mode: stage 0 runs an OpenAI-compatible HTTP server in front of the pipeline.

    mpiexec -n 2 python workflow/scripts/serve.py --config results/config/inference.json \
        --model results/train/final
    curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "distlm", "prompt": "The for statement", "max_tokens": 16, "stream": true}'

`rule serve` puts `distlm.inference.front` before it, outside the MPI job, so clients still get a 503
when a killed rank takes the whole job down (stage 0 included).

Endpoints: POST /v1/completions (OpenAI's completions API, `stream` as server-sent events),
GET /v1/models, GET /health. HTTP handler threads validate a request, tokenize it and queue one
sequence per prompt; the main thread (the only one that talks MPI) moves queued sequences into free
pipeline lanes and hands tokens back to the handlers. Bad requests get a 4xx with an OpenAI-style
JSON error; when the pipeline is gone (a stage died or hangs) every open request gets 503, and the
job ends with an error once they are answered (at most `_ANSWER_503_S` later).
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import signal
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from distlm.inference.front import OpenCount
from distlm.inference.pipeline import (
    Backoff,
    Pipeline,
    PipelineError,
    Sequence,
    mpi_pipeline,
    run_workers,
)
from distlm.inference.prompts import RequestError, encode_prompt
from distlm.inference.sampling import make_params
from distlm.io import pid_alive, write_json
from distlm.log import get_logger

log = get_logger(__name__)

OPENAI_DEFAULT_MAX_TOKENS = 16
_DRAIN_LIMIT = 16 << 20  # an oversized body up to this size is read (and dropped) before the 413
_ANSWER_503_S = 5.0  # after a failure, how long the open requests get to receive their 503
_UNSUPPORTED = {  # field: the only accepted value(s)
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None,),
    "suffix": (None, ""),
    "stop": (None, [], ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class _Pending:
    """One HTTP request's sequences and the events the main thread sends back for them."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.seqs: list[Sequence] = []

    def on_token(self, seq: Sequence, token: int) -> None:
        self.events.put(("token", seq, token))

    def on_done(self, seq: Sequence) -> None:
        self.events.put(("done", seq, seq.finish_reason))


class CompletionServer:
    """The HTTP front of a running pipeline (stage 0 only)."""

    def __init__(self, pipe: Pipeline, icfg: dict, *, model_id: str, host: str | None = None, port: int | None = None):
        self.pipe = pipe
        self.sched = pipe.scheduler
        self.tok = pipe.tokenizer
        self.icfg = icfg
        self.scfg = icfg["serve"]
        self.model_id = model_id
        self.inbox: queue.Queue = queue.Queue()
        self.failed: str | None = None
        self.stopping = threading.Event()
        self.pending: dict[int, _Pending] = {}  # sequence id -> its request (main thread only)
        self._ids = iter(range(1 << 62))
        self._ids_lock = threading.Lock()
        # A fast tokenizer's Rust state must not be borrowed by two threads at once ("Already borrowed")
        self._tok_lock = threading.Lock()
        self.open = OpenCount()  # completion requests not yet answered (handler threads)
        handler = type("Handler", (_Handler,), {"app": self})
        host = self.scfg["host"] if host is None else host
        port = self.scfg["port"] if port is None else port
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.address = self.httpd.server_address

    # ---------------------------------------------------------------- main thread

    def serve(self, *, front_pid: int | None = None) -> None:
        """Answer requests until SIGTERM/SIGINT; raises PipelineError (after the 503s) if a stage fails.

        `front_pid`: the HTTP front's process; if it disappears, stop as if signalled.
        """
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        thread.start()
        host, port = self.address[:2]
        behind = f" behind the HTTP front (pid {front_pid})" if front_pid is not None else ""
        log.info("serving %s on http://%s:%d%s (/v1/completions, /v1/models, /health)",
                 self.model_id, host, port, behind)
        heartbeat_s = min(1.0, self.icfg["timeout_s"] / 4)
        backoff = Backoff()
        checked = time.monotonic()
        try:
            while not self.stopping.is_set():
                if front_pid is not None and time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    if not pid_alive(front_pid):
                        log.error("the HTTP front (pid %d) is gone; stopping", front_pid)
                        break
                admitted = self._admit(block=False)
                if self.sched.step() or admitted:
                    backoff.reset()
                elif not self.sched.busy:
                    self.sched.heartbeat(heartbeat_s)
                    self._admit(block=True)
                else:
                    t0 = time.perf_counter()
                    backoff.pause()
                    self.sched.stats.recv_wait_s += time.perf_counter() - t0
            log.info("stopping: %d sequences still active get 503", len(self.sched.active) + len(self.sched.waiting))
            self.failed = "the server is shutting down"
            self.sched.launching = False
            while self.sched.inflight:  # let the micro-batches in the ring come home
                if not self.sched.step():
                    backoff.pause()
            self._wait_answered(self.failed)
        except PipelineError as e:
            self.fail(str(e))
            raise
        except Exception as e:  # a bug here must not leave clients waiting either
            self.fail(f"stage 0 failed: {type(e).__name__}: {e}")
            raise
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()

    def _admit(self, *, block: bool) -> bool:
        try:
            pending, seqs = self.inbox.get(timeout=0.005) if block else self.inbox.get_nowait()
        except queue.Empty:
            return False
        for s in seqs:
            self.pending[s.id] = pending
            s.on_done = self._finished
            self.sched.submit(s)
        return True

    def _finished(self, seq: Sequence) -> None:
        self.pending.pop(seq.id).on_done(seq)

    def _reject_all(self, reason: str) -> None:
        """503 for every sequence not yet finished and every request still in the inbox."""
        for seq in self.sched.fail_all(reason):
            p = self.pending.pop(seq.id, None)
            if p is not None:
                p.events.put(("error", 503, reason))
        while True:
            try:
                pending, _ = self.inbox.get_nowait()
            except queue.Empty:
                break
            pending.events.put(("error", 503, reason))

    def fail(self, reason: str) -> None:
        """The pipeline is gone: every waiting handler (and every later request) gets a 503."""
        self.failed = reason
        log.error("pipeline failed, answering 503: %s", reason)
        self._wait_answered(reason)

    def _wait_answered(self, reason: str) -> None:
        """503 to every open request; the job ends after this returns, so wait until they are written."""
        # _reject_all before every look: a request may have been queued since
        left = self.open.wait_answered(_ANSWER_503_S, each=lambda: self._reject_all(reason))
        if left:
            log.error("%d requests still open after %g s; ending the job", left, _ANSWER_503_S)

    # ---------------------------------------------------------------- handler threads

    def new_seq_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def build(self, body: dict) -> tuple[_Pending, list[dict], bool, dict]:
        """Validate a completions request; (pending, per-prompt info, stream, options)."""
        if not isinstance(body, dict):
            raise RequestError("request body: expected a JSON object")
        for k, allowed in _UNSUPPORTED.items():
            if k in body and body[k] not in allowed:
                raise RequestError(f"{k}: {body[k]!r} is not supported by this server", param=k)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        elif prompt is None:
            raise RequestError("prompt: required", param="prompt")
        else:
            raise RequestError("prompt: expected a string or a non-empty list of strings", param="prompt")
        if len(prompts) > self.icfg["lanes"]:
            raise RequestError(
                f"prompt: {len(prompts)} prompts in one request, at most {self.icfg['lanes']} (inference.lanes)",
                param="prompt",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream: expected true or false", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise RequestError("stream_options: expected an object", param="stream_options")

        def opt(name, default):
            v = body.get(name)
            return default if v is None else v

        cfg = self.icfg
        params = make_params(
            max_new_tokens=opt("max_tokens", OPENAI_DEFAULT_MAX_TOKENS),
            temperature=opt("temperature", 0.0 if cfg["greedy"] else cfg["temperature"]),
            top_k=opt("top_k", cfg["top_k"]),
            top_p=opt("top_p", cfg["top_p"]),
            seed=opt("seed", cfg["seed"]),
            context=self.pipe.context,
            max_allowed=self.scfg["max_tokens"],
        )
        pending, infos = _Pending(), []
        for i, text in enumerate(prompts):
            try:
                with self._tok_lock:
                    ids, cut = encode_prompt(
                        self.tok, text, context=self.pipe.context, max_new_tokens=params.max_new_tokens,
                        overflow=cfg["prompt_overflow"],
                    )
            except RequestError as e:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise RequestError(str(e).replace("prompt:", f"{where}:", 1), param="prompt") from None
            seq = Sequence(self.new_seq_id(), ids, params, on_token=pending.on_token)
            pending.seqs.append(seq)
            infos.append({"index": i, "prompt_tokens": len(ids), "prompt_truncated_tokens": cut})
        return pending, infos, stream, opts

    def decode(self, tokens: list[int]) -> str:
        with self._tok_lock:
            return self.tok.decode(tokens, skip_special_tokens=True)

    def submit(self, pending: _Pending) -> None:
        if self.failed:
            raise _Unavailable(self.failed)
        self.inbox.put((pending, pending.seqs))

    def health(self) -> tuple[int, dict]:
        if self.failed:
            return 503, {"status": "unavailable", "error": self.failed}
        return 200, {
            "status": "ok",
            "model": self.model_id,
            "stages": self.pipe.topo.stages,
            "lanes": self.icfg["lanes"],
            "active": len(self.sched.active),
            "waiting": len(self.sched.waiting),
            "pipeline": self.pipe.infos,
        }


class _Unavailable(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    app: CompletionServer
    server_version = "distlm"
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *args) -> None:
        log.info("http %s - %s", self.address_string(), fmt % args)

    # -------------------------------------------------------------- plumbing

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        self._json(status, {"error": {
            "message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code,
        }})

    def _authorized(self) -> bool:
        token = self.app.scfg["token"]
        if not token:
            return True
        got = self.headers.get("Authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), token.encode()):
            return True
        self._error(401, "missing or wrong bearer token (Authorization: Bearer ...)", code="invalid_api_key")
        return False

    # -------------------------------------------------------------- routes

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._json(*self.app.health())
        elif path == "/v1/models":
            if self._authorized():
                self._json(200, {"object": "list", "data": [
                    {"id": self.app.model_id, "object": "model", "created": 0, "owned_by": "distlm"}
                ]})
        elif path == "/v1/completions":
            self._error(405, "use POST for /v1/completions")
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self._error(404 if path not in ("/health", "/v1/models") else 405, f"no POST route {path}")
            return
        if not self._authorized():
            return
        with self.app.open:
            self._completions()

    def _completions(self) -> None:
        body = self._read_body()
        if body is None:
            return
        try:
            pending, infos, stream, opts = self.app.build(body)
            self.app.submit(pending)
        except RequestError as e:
            self._error(e.status, str(e), param=e.param)
            return
        except _Unavailable as e:
            self._error(503, f"the pipeline is unavailable: {e}")
            return
        if stream:
            self._stream(pending, infos, opts)
        else:
            self._complete(pending, infos)

    def _read_body(self):
        limit = self.app.scfg["max_request_bytes"]
        length = self.headers.get("Content-Length")
        if length is None:
            self._error(411, "Content-Length header required")
            return None
        try:
            n = int(length)
        except ValueError:
            self._error(400, f"Content-Length: not a number: {length!r}")
            return None
        if n > limit:
            if n <= _DRAIN_LIMIT:
                self.rfile.read(n)
            self._error(413, f"request body of {n} bytes is over the limit of {limit} (inference.serve.max_request_bytes)")
            return None
        raw = self.rfile.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._error(400, f"request body is not valid UTF-8 ({e})")
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            self._error(400, f"request body is not valid JSON ({e})")
            return None

    def _events(self, pending: _Pending):
        """Events for this request until every sequence is done; a stalled pipeline ends them with 503."""
        left = len(pending.seqs)
        wait = self.app.icfg["timeout_s"] + 10
        while left:
            try:
                ev = pending.events.get(timeout=wait)
            except queue.Empty:
                ev = ("error", 503, f"no progress for {wait:g} s")
            if ev[0] == "done":
                left -= 1
            yield ev
            if ev[0] == "error":
                return

    def _base(self, cid: str) -> dict:
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.app.model_id}

    def _complete(self, pending: _Pending, infos: list[dict]) -> None:
        for ev in self._events(pending):
            if ev[0] == "error":
                self._error(ev[1], f"the pipeline is unavailable: {ev[2]}")
                return
        choices = []
        for seq, info in zip(pending.seqs, infos):
            choices.append({
                "text": self.app.decode(seq.tokens),
                "index": info["index"],
                "logprobs": None,
                "finish_reason": seq.finish_reason,
                "prompt_truncated_tokens": info["prompt_truncated_tokens"],
            })
        out = self._base(f"cmpl-{uuid.uuid4().hex}")
        out["choices"] = choices
        out["usage"] = _usage(pending, infos)
        warnings = _warnings(infos)
        if warnings:
            out["warnings"] = warnings
        self._json(200, out)

    def _stream(self, pending: _Pending, infos: list[dict], opts: dict) -> None:
        cid = f"cmpl-{uuid.uuid4().hex}"
        index = {seq.id: info["index"] for seq, info in zip(pending.seqs, infos)}
        sent = {seq.id: "" for seq in pending.seqs}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def emit(obj) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def chunk(i: int, text: str, reason: str | None, extra: dict | None = None) -> dict:
            c = self._base(cid)
            c["choices"] = [{"text": text, "index": i, "logprobs": None, "finish_reason": reason, **(extra or {})}]
            return c

        try:
            for ev in self._events(pending):
                if ev[0] == "error":
                    emit({"error": {"message": f"the pipeline is unavailable: {ev[2]}",
                                    "type": _ERROR_TYPES[503], "param": None, "code": None}})
                    return
                seq = ev[1]
                text = self.app.decode(seq.tokens)
                done = ev[0] == "done"
                if not done and text.endswith("\ufffd"):
                    continue  # a multi-byte character is not complete yet
                delta = text[len(sent[seq.id]):]
                sent[seq.id] = text
                if done:
                    info = infos[index[seq.id]]
                    emit(chunk(index[seq.id], delta, seq.finish_reason,
                               {"prompt_truncated_tokens": info["prompt_truncated_tokens"]}))
                elif delta:
                    emit(chunk(index[seq.id], delta, None))
            if opts.get("include_usage"):
                c = self._base(cid)
                c["choices"] = []
                c["usage"] = _usage(pending, infos)
                emit(c)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            for seq in pending.seqs:
                seq.cancelled = True  # the client went away: free its lanes at the next token
            log.info("client went away during a stream; cancelled %d sequences", len(pending.seqs))


def _usage(pending: _Pending, infos: list[dict]) -> dict:
    p = sum(i["prompt_tokens"] for i in infos)
    c = sum(len(s.tokens) for s in pending.seqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _warnings(infos: list[dict]) -> list[str]:
    return [
        f"prompt {i['index']}: dropped its first {i['prompt_truncated_tokens']} tokens to fit the context "
        "(inference.prompt_overflow is truncate)"
        for i in infos if i["prompt_truncated_tokens"]
    ]


def run_server(
    icfg: dict, *, model_dir, host: str | None = None, port: int | None = None, device: str = "cpu",
    ready_file: str | Path | None = None, front_pid: int | None = None,
) -> None:
    """Serve mode: every rank calls this; stage 0 serves HTTP until SIGTERM/SIGINT, then stops the rest.

    `ready_file`: once stage 0 listens, it writes {"hostname", "host", "port", "pid"} there (the HTTP
    front in `distlm.inference.front` waits for it, so port 0, any free port, works); `front_pid`: that
    front, whose end stops the pipeline.
    """
    with mpi_pipeline(icfg, model_dir, device=device) as pipe:
        if not pipe.topo.is_first:
            # Ctrl-C reaches every rank; only stage 0 acts on it, and stops the others through the ring.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not run_workers(pipe):
            return
        server = CompletionServer(pipe, icfg, model_id=Path(model_dir).resolve().name, host=host, port=port)
        if ready_file is not None:
            bound_host, bound_port = server.address[:2]
            write_json(ready_file, {
                "hostname": socket.gethostname(), "host": bound_host, "port": bound_port, "pid": os.getpid(),
            })
        server.serve(front_pid=front_pid)
        stats = pipe.scheduler.stop()
        log.info("server stopped; per-stage time: %s", json.dumps(stats))
