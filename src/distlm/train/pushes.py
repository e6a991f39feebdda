"""Pushes of the weights into a server that follows the training run (serve.follow_training;
docs/serving.md, "Serve while training").

After each checkpoint's save (train.ckpt_every steps, and the last), every rank calls
`Pusher.at_checkpoint`. Rank 0 looks for the endpoint document a following server writes
(results/serve/endpoint.json: `ServeEndpoint`); when one is there and no push of an earlier step
is still running, the whole model is gathered to rank 0's host memory (under fsdp every rank takes
part: the layout's `full_hf_tensors`) and a background thread:

1. names the weights: the sha256 of the model.safetensors the step's checkpoint holds (the same
   tensors, so the same bytes: distlm.model.folder.SAFETENSORS_METADATA): after the push the
   server's system_fingerprint is what an update from that checkpoint's folder gives;
2. offers them: POST /update_weights_from_distributed with the offer of its store
   (distlm.transfer.push), the token read from the source the endpoint names;
3. sends each server stage the tensors it asks for, cast to its dtype, bucketed and checksummed,
   GPU to GPU over NCCL when the stage serves on another GPU than this rank's, through host
   memory otherwise (distlm.transfer.push.route_for; transfer.transport uccl: over UCCL); the
   server switches every stage or none, and answers.

Training never waits on the server: the loop pays the copy to host memory; a server that is gone,
refuses or fails is logged and skipped; a checkpoint that comes while a push still runs is not
pushed (logged), but the last step's is: it goes once the running one has ended. At the end of
the run the last push is waited for, at most twice transfer.timeout_s.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.core.documents import DocumentError, read_document
from distlm.core.log import get_logger
from distlm.model.folder import safetensors_sha256
from distlm.settings import TransferSettings
from distlm.transfer.documents import PUSH_ROUTE, ServeEndpoint
from distlm.transfer.errors import TransferError

if TYPE_CHECKING:
    from distlm.runtime.dist import Topology
    from distlm.train.faults import Faults
    from distlm.train.state import TrainState

log = get_logger("distlm.train.pushes")


@dataclass(frozen=True)
class PushOutcome:
    """How one push ended (the log says it; tests read it)."""

    step: int
    ok: bool
    message: str
    seconds: float
    fingerprint: str | None = None


class Pusher:
    """The run's pushes: every rank calls `at_checkpoint` after a save, and `close` at the end."""

    def __init__(
        self,
        endpoint: Path,
        settings: TransferSettings,
        topo: Topology,
        faults: Faults | None = None,
    ) -> None:
        self.endpoint, self.settings, self.topo, self.faults = endpoint, settings, topo, faults
        self.outcomes: list[PushOutcome] = []
        self._thread: threading.Thread | None = None
        self._sender = None  # distlm.transfer.push.PushSender, opened at the first push
        self._seen: str | None = None  # the endpoint last logged

    def _target(self) -> ServeEndpoint | None:
        """The following server's endpoint, or None (no server follows); a change is logged."""
        try:
            target = (
                read_document(self.endpoint, ServeEndpoint) if self.endpoint.is_file() else None
            )
        except (DocumentError, DistlmError, OSError) as e:
            log.warning("%s: not read (%s); no push", self.endpoint, e)
            target = None
        now = target.url if target is not None else None
        if now != self._seen:
            if now is not None:
                log.info("a server follows this run at %s: each checkpoint is pushed there", now)
            else:
                log.info("no server follows this run any more (%s is gone)", self.endpoint)
            self._seen = now
        return target

    def at_checkpoint(self, step: int, state: TrainState, *, last: bool = False) -> None:
        """All ranks, after step `step`'s checkpoint: its weights go to the following server in
        rank 0's background thread (see the module doc). The `last` step's push is not skipped
        when one runs: its thread waits for that one to end first (at most
        transfer.timeout_s), so that the server ends on the final weights."""
        target = None
        if self.topo.is_main:
            target = self._target()
            running = self._thread is not None and self._thread.is_alive()
            if target is not None and running and not last:
                log.warning(
                    "step %d: not pushed: the push of an earlier step still runs (pushes come "
                    "slower than checkpoints; a larger train.ckpt_every spares the server)",
                    step,
                )
                target = None
        go = [target is not None]
        if self.topo.is_distributed:  # under fsdp every rank gathers, so every rank must know
            dist.broadcast_object_list(go, src=0)
        if not go[0]:
            return
        t0 = time.perf_counter()
        full = state.layout.full_hf_tensors(state.model)  # all ranks (fsdp gathers to rank 0)
        if not self.topo.is_main:
            return
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in full.items()}
        log.info("step %d: weights copied for the push in %.2f s", step, time.perf_counter() - t0)
        assert target is not None
        self._thread = threading.Thread(
            target=self._push,
            args=(step, tensors, state.model.args.signature(), target, self._thread),
            name=f"push-{step}",
            daemon=True,
        )
        self._thread.start()

    def _push(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        architecture: dict,
        target: ServeEndpoint,
        before: threading.Thread | None,
    ) -> None:
        if before is not None and before.is_alive():  # the last step's, after the running one
            log.info("step %d: the last push waits for the one that runs", step)
            before.join(self.settings.timeout_s)
            if before.is_alive():
                self._log(PushOutcome(step, False, "the push before it still runs", 0.0), target)
                return
        t0 = time.perf_counter()
        try:
            outcome = self._offer(step, tensors, architecture, target, t0)
        except Exception as e:  # nothing a push meets may stop training
            outcome = PushOutcome(step, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)
        self._log(outcome, target)

    def _log(self, outcome: PushOutcome, target: ServeEndpoint) -> None:
        self.outcomes.append(outcome)
        step = outcome.step
        if outcome.ok:
            log.info(
                "step %d: pushed to %s in %.2f s: %s (%s)",
                step,
                target.url,
                outcome.seconds,
                outcome.message,
                outcome.fingerprint,
            )
        else:
            log.warning(
                "step %d: not pushed to %s (training goes on): %s",
                step,
                target.url,
                outcome.message,
            )

    def _offer(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        architecture: dict,
        target: ServeEndpoint,
        t0: float,
    ) -> PushOutcome:
        from distlm.transfer.push import PushSender

        digest = safetensors_sha256(tensors)
        host = reachable_host(target.url)
        if self._sender is None or self._sender.host != host:  # the first push, or a server moved
            # a part bound GPU to GPU is put on this rank's GPU (distlm.transfer.push.route_for)
            self._sender = PushSender.open(
                host=host, settings=self.settings, device=self.topo.device
            )
        offer = self._sender.offer(digest, f"step {step}", architecture)
        log.info("step %d: offering weights %s to %s", step, digest[:16], target.url)
        body = {**offer.model_dump(mode="json"), "policy": "wait"}
        answered = threading.Event()
        reply: dict = {}

        def post() -> None:
            try:
                reply["answer"] = _post(target, body, timeout_s=2 * self.settings.timeout_s + 300)
            except Exception as e:
                reply["error"] = e
            finally:
                answered.set()

        threading.Thread(target=post, name=f"push-{step}-http", daemon=True).start()
        sent_error: TransferError | None = None
        try:
            hook = self.faults.push_hook(step) if self.faults is not None else None
            self._sender.send(offer, tensors, done=answered.is_set, hook=hook)
        except TransferError as e:
            sent_error = e  # the server's answer says how the update ended; keep this for why
        answered.wait()
        seconds = time.perf_counter() - t0
        if "error" in reply:
            raise reply["error"]
        status, answer = reply["answer"]
        message = str(answer.get("message") or answer.get("error", {}).get("message") or answer)
        if status == 200 and answer.get("success"):
            return PushOutcome(step, True, message, seconds, answer.get("system_fingerprint"))
        if sent_error is not None:
            message = f"{message} (here: {sent_error})"
        return PushOutcome(step, False, f"HTTP {status}: {message}", seconds)

    def close(self, *, wait: bool = True) -> None:
        """All ranks, at the end of the run: the last push is waited for (with `wait`; not when
        the run was told to stop), at most twice transfer.timeout_s (it may wait for the one
        before it)."""
        t = self._thread
        if wait and t is not None and t.is_alive():
            limit = 2 * self.settings.timeout_s
            log.info("waiting for the last push (at most %g s)", limit)
            t.join(limit)
            if t.is_alive():
                log.warning("the last push still runs; not waited for any longer")
        self._sender = None  # its store stops with it


def reachable_host(url: str) -> str:
    """The address the server's stages reach this process by, and the one its push store listens
    on (alone): this host's address on the route to the server, loopback when the server listens
    on it. (Not the host's name: Debian maps that to 127.0.1.1, which no other host reaches.)"""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, parts.port or 80, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # a datagram socket's connect sends nothing: it picks the route
            return s.getsockname()[0]
    except OSError as e:
        raise DistlmError(f"the server's endpoint {url}: no route to {host!r} ({e})") from None


def _token(target: ServeEndpoint) -> str | None:
    """The server's bearer token from the source its endpoint names (never the token itself)."""
    if target.token_file:
        return Path(target.token_file).read_text(encoding="utf-8").strip() or None
    if target.token_env:
        value = os.environ.get(target.token_env, "").strip()
        if not value:
            raise DistlmError(
                f"the server's token is in environment variable {target.token_env}, which this "
                "job does not have"
            )
        return value
    return None


def _post(target: ServeEndpoint, body: dict, *, timeout_s: float) -> tuple[int, dict]:
    """POST `body` to the server's push route: (HTTP status, the JSON answer)."""
    headers = {"Content-Type": "application/json"}
    token = _token(target)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        target.url.rstrip("/") + PUSH_ROUTE, data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return e.code, {"message": raw[:300].decode("utf-8", "replace")}
