"""Stage 0's engine in serve mode: requests from the API server over ZeroMQ into the scheduler.

    mpiexec -n S python -m distlm.entry.serve --engine --config results/config/serve.json \
        --model results/train/final --channel /tmp/distlm-serve-x --api-servers 2 --api-pid PID

The API server's supervisor (distlm.inference.server.supervisor) starts this with the launcher;
nobody else needs to. Stage 0 serves no HTTP. Each API server process has a channel of its own
(messages.endpoints: 0 is the supervisor's, 1..N the HTTP processes'): stage 0 pulls Attach /
Submit / Cancel / Shutdown from each, and pushes a request's Token, Prompt, Finish and Error to
the channel it came from; Ready, Health and a pipeline failure go to every channel
(distlm.inference.messages). One thread does everything, so the MPI calls, the scheduler and the
sockets never race.

An Update (new weights from a folder) is stage 0's Updater's (engine/update.py): it stages the
weights on every stage while the engine serves on, holds new requests back by the update's
policy, switches every stage between two steps, tells every channel the new weights (Ready) and
answers Updated to the process that asked.

Stage 0 stops in order on Shutdown or SIGINT/SIGTERM, and on its own when the supervisor's process
is gone. When the pipeline fails (a stage died or hangs), it sends Error(rid=None) so the API
servers answer 503, and the job ends (MPI_Abort).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Self

import zmq

from distlm.core.io import pid_alive
from distlm.core.log import get_logger
from distlm.inference.engine.bootstrap import Pipeline, mpi_pipeline, run_workers
from distlm.inference.engine.ring import Pick, PipelineError
from distlm.inference.engine.scheduler import Sequence, run_stage0
from distlm.inference.engine.update import ABORT, Outcome, Updater
from distlm.inference.messages import (
    Attach,
    Cancel,
    ChannelError,
    Error,
    Finish,
    Health,
    Prompt,
    Ready,
    Shutdown,
    Submit,
    TokenBatch,
    Update,
    Updated,
    UpdateRecord,
    decode,
    encode,
    encode_batch,
    endpoints,
)
from distlm.settings import EngineSettings, derived_seed

log = get_logger(__name__)

HEALTH_EVERY_S = 0.5  # how often stage 0 tells the API server its queue and lanes
_API_CHECK_S = 1.0  # how often stage 0 looks whether the API server's process still exists
# how long an idle stage 0 waits on the channel at a time: a request wakes it at once, so this
# only spaces the idle loop's checks (heartbeat, Health, the API server's process)
_IDLE_WAIT_MS = 50
_PING_EVERY_S = 0.005  # while an update waits for the stages' words, an idle ring carries them
_LINGER_MS = 2000  # how long closing the events socket may take to deliver the last messages


class Channel:
    """The engine's sockets, a PULL and a PUSH per API server process (0: the supervisor);
    closed (with a bounded linger) on every exit path."""

    def __init__(self, folder: str, api_servers: int) -> None:
        self.ctx = zmq.Context()
        self.pulls: list[zmq.Socket] = []
        self.pushes: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        for k in range(api_servers + 1):
            requests, events = endpoints(folder, k)
            pull, push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, _LINGER_MS)
            push.setsockopt(zmq.SNDHWM, 0)  # never block stage 0: the API servers bound the load
            pull.connect(requests)
            push.connect(events)
            self.poller.register(pull, zmq.POLLIN)
            self.pulls.append(pull)
            self.pushes.append(push)
        self.source = {pull: k for k, pull in enumerate(self.pulls)}
        # sent by flush(), one frame per engine step and channel
        self.pending: list[list] = [[] for _ in self.pushes]

    def send(self, msg, to: int | None = None) -> None:
        """Queue a message for channel `to` (None: every channel); flush() sends what one engine
        step produced as one frame a channel."""
        for k in range(len(self.pending)) if to is None else (to,):
            self.pending[k].append(msg)

    def token(
        self,
        to: int,
        rid: int,
        index: int,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
    ) -> None:
        """Queue a new token for channel `to`: it joins the TokenBatch that the channel's last
        queued message is, else starts one (so every message keeps its order)."""
        pending = self.pending[to]
        batch = pending[-1] if pending else None
        if not isinstance(batch, TokenBatch):
            batch = TokenBatch()
            pending.append(batch)
        batch.add(rid, index, token, logprob, top)

    def flush(self) -> None:
        for k, msgs in enumerate(self.pending):
            if msgs:
                self.pending[k] = []
                self.pushes[k].send(encode(msgs[0]) if len(msgs) == 1 else encode_batch(msgs))

    def recv(self, timeout_ms: int = 0) -> list[tuple[int, object]]:
        """The requests that arrive within timeout_ms, one from each channel that has one:
        [(channel, message)]; a frame that is not a message is logged and dropped."""
        out = []
        for sock, _ in self.poller.poll(timeout_ms):
            frame = sock.recv()
            try:
                out.append((self.source[sock], decode(frame)))
            except ChannelError as e:  # the API servers are the only senders: a bug, say so
                log.error("engine channel %d: %s (dropped)", self.source[sock], e)
        return out

    def close(self) -> None:
        self.flush()
        for pull in self.pulls:
            pull.close(linger=0)
        for push in self.pushes:
            push.close()
        self.ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Engine:
    """Stage 0's loop: admit requests, step the scheduler, stream tokens back."""

    def __init__(
        self,
        pipe: Pipeline,
        settings: EngineSettings,
        channel: Channel,
        *,
        api_pid: int | None,
    ):
        self.pipe = pipe
        self.sched = pipe.stage0
        self.settings = settings
        self.ch = channel
        self.api_pid = api_pid
        # a request is (channel, rid): each API server process numbers its own
        self.requests: dict[tuple[int, int], list[Sequence]] = {}  # request -> its sequences
        # sequence id -> (channel, rid, index); channel None: its API process is gone (muted)
        self.where: dict[int, tuple[int | None, int, int]] = {}
        self.stopping: str | None = None
        self._checked = self._health_at = time.monotonic()  # API server looked for, Health sent
        self.last_update: UpdateRecord | None = None
        self._pinged = 0.0
        ring = self.sched.send_ring if pipe.ring is not None else None
        self.updater = Updater(
            pipe.model,
            stages=pipe.topo.world_size,
            tied=pipe.tied,
            expected=pipe.tensors,
            ring_send=ring,
            hold=lambda on: setattr(self.sched, "hold", self._not_started if on else None),
            cancel_open=self._abort_open,
            # no sequence runs, and no micro-batch of one is on the device (steps_in_flight)
            idle=lambda: not self.sched.active and not self.sched.local,
            switched=lambda weights: setattr(self.pipe, "weights", weights),
            done=self._updated,
        )
        self.sched.on_ring = self.updater.echoed

    def ready(self) -> Ready:
        tok = self.pipe.tokenizer
        return Ready(
            hostname=socket.gethostname(),
            pid=os.getpid(),
            context=self.pipe.context,
            vocab_size=len(tok),
            eos_token_id=self.pipe.eos_token_id,
            lanes=self.settings.lanes,
            stages=self.pipe.topo.world_size,
            pipeline=self.pipe.infos,
            weights=self.pipe.weights,
            last_update=self.last_update,
        )

    def run(self) -> None:
        """Serve until Shutdown, a signal or the API server's end; PipelineError after Error."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", "stopped by a signal"))
        self.ch.send(self.ready())
        self.ch.flush()
        self._checked = self._health_at = time.monotonic()
        heartbeat_s = min(1.0, self.settings.timeout_s / 4)

        def idle() -> None:
            self.sched.heartbeat(heartbeat_s)
            self._take(1 if self.updater.busy else _IDLE_WAIT_MS)

        try:
            run_stage0(
                self.sched,
                more=lambda: self.stopping is None,
                poll=self._poll,
                after_step=self.ch.flush,  # this step's tokens, finishes and errors: one frame
                idle=idle,
            )
            log.info("stopping (%s): %d sequences still open", self.stopping, len(self.where))
            self.sched.drain(self.settings.timeout_s)  # the micro-batches in the ring come home
        except PipelineError as e:
            self._failed(str(e))
            raise
        except Exception as e:  # a bug here must not leave clients waiting either
            self._failed(f"stage 0 failed: {type(e).__name__}: {e}")
            raise

    def _poll(self) -> bool:
        """Before each step: whether the supervisor lives, Health when due, the requests waiting."""
        now = time.monotonic()
        if self.api_pid is not None and now - self._checked > _API_CHECK_S:
            self._checked = now
            if not pid_alive(self.api_pid):
                self.stopping = f"the API server's supervisor (pid {self.api_pid}) is gone"
                return False
        if now - self._health_at > HEALTH_EVERY_S:
            self._health_at = now
            self.ch.send(self.health())
        took = self._take(0)
        if self.updater.busy:
            if self.sched.words:
                self.updater.heard(self.sched.words)
                self.sched.words.clear()
            if self.updater.poll() and now - self._pinged > _PING_EVERY_S:
                self._pinged = now
                self.sched.ping()
        return took

    def _failed(self, reason: str) -> None:
        """The pipeline is gone: free every lane here, and one Error(rid=None) for all requests."""
        failed = self.sched.fail_all(reason)
        log.error(
            "pipeline failed (%d sequences open); the API server answers 503: %s",
            len(failed),
            reason,
        )
        self.requests.clear()
        self.where.clear()
        self.ch.send(Error(rid=None, index=None, status=503, message=reason))
        self.ch.flush()

    def health(self) -> Health:
        s = self.sched
        stages = [s.stats.brief(), *(s.stage_stats[k] for k in sorted(s.stage_stats))]
        return Health(
            active=len(s.active),
            waiting=len(s.waiting) + sum(len(q.siblings) for q in s.waiting),
            lanes_busy=s.lanes_busy,
            stages=stages,
        )

    # ------------------------------------------------------------------ requests

    def _take(self, timeout_ms: int) -> bool:
        """Handle every request waiting on the channels; whether there was one."""
        took = False
        while True:
            got = self.ch.recv(timeout_ms if not took else 0)
            if not got:
                return took
            took = True
            for source, msg in got:
                if isinstance(msg, Submit):
                    self._submit(source, msg)
                elif isinstance(msg, Cancel):
                    for seq in self.requests.get((source, msg.rid), ()):
                        if msg.index is None or self.where.get(seq.id, (0, 0, -1))[2] == msg.index:
                            self.sched.cancel(seq)
                elif isinstance(msg, Attach):
                    self._attach(source, msg)
                elif isinstance(msg, Update):
                    out = self.updater.begin((source, msg.rid), msg, self.pipe.weights)
                    if out is not None:
                        self._updated(out, (source, msg.rid))
                elif isinstance(msg, Shutdown):
                    self.stopping = msg.reason
                    return took
                else:
                    log.error(
                        "engine channel %d: unexpected %s from the API server",
                        source,
                        type(msg).__name__,
                    )

    def _attach(self, source: int, msg: Attach) -> None:
        """An API server process (re)started on channel `source`: its predecessor's sequences
        are cancelled, their events muted (their clients are gone), and it gets Ready."""
        gone = [key for key in self.requests if key[0] == source]
        for key in gone:
            for seq in self.requests.pop(key):
                if seq.id in self.where:
                    self.where[seq.id] = (None, *self.where[seq.id][1:])
                    self.sched.cancel(seq)
        if gone:
            log.info(
                "API server channel %d: process %d attached; %d requests of its predecessor "
                "cancelled",
                source,
                msg.pid,
                len(gone),
            )
        self.ch.send(self.ready(), to=source)

    # ------------------------------------------------------------------ updates

    def _not_started(self, seq: Sequence) -> bool:
        """While an update drains: whether `seq` waits (none of its request's sequences has
        started: a request runs on one set of weights, all its choices)."""
        where = self.where.get(seq.id)
        if where is None:
            return False
        return not any(s.t_admit for s in self.requests.get((where[0], where[1]), ()))  # type: ignore[arg-type]

    def _abort_open(self) -> None:
        """Policy abort: every request with a sequence running ends now, finish reason abort."""
        for seqs in list(self.requests.values()):  # a request that ends leaves the dict
            if any(s.t_admit for s in seqs):
                for seq in seqs:
                    self.sched.cancel(seq, ABORT)

    def _updated(self, out: Outcome, to: tuple[int, int]) -> None:
        """An update ended: on a switch, every channel hears the new weights (before any token
        they produce); the process that asked hears how it went."""
        if out.changed:
            self.last_update = UpdateRecord(
                source=out.source,
                kind=out.kind,
                weights=out.weights,
                seconds=out.seconds,
                bytes=out.bytes,
                at=time.time(),
                stall=out.stall,
            )
            self.ch.send(self.ready())
        channel, rid = to
        self.ch.send(
            Updated(
                rid=rid,
                status=out.status,
                message=out.message,
                weights=out.weights,
                changed=out.changed,
                seconds=out.seconds,
                bytes=out.bytes,
                stall=out.stall,
            ),
            channel,
        )

    def _submit(self, source: int, msg: Submit) -> None:
        params = msg.params
        seqs = []
        for i, ids in enumerate(msg.prompts):
            group = []
            for j in range(msg.n):
                p = (
                    params
                    if j == 0
                    else dataclasses.replace(params, seed=derived_seed(params.seed, j))
                )
                seq = Sequence(
                    self.sched.new_id(),
                    list(ids),
                    p,
                    on_token=self._token,
                    on_done=self._done,
                    on_prompt=self._prompt,
                )
                self.where[seq.id] = (source, msg.rid, i * msg.n + j)
                group.append(seq)
            group[0].siblings = group[1:]
            seqs.extend(group)
            self.sched.submit(group[0])
        self.requests[(source, msg.rid)] = seqs

    def _token(self, seq: Sequence, pick: Pick) -> None:
        source, rid, index = self.where[seq.id]
        if source is None:
            return
        top = None if pick.top is None else list(pick.top)
        self.ch.token(source, rid, index, pick.token, pick.logprob, top)

    def _prompt(self, seq: Sequence, pick: Pick) -> None:
        source, rid, index = self.where[seq.id]
        if source is None or pick.prompt is None:  # the scheduler calls this only for a pick
            return  # that carries it
        self.ch.send(
            Prompt(
                rid=rid,
                index=index,
                logprobs=[None, *(lp for lp, _ in pick.prompt)],
                top=[None, *(list(top) for _, top in pick.prompt)],
            ),
            source,
        )

    def _done(self, seq: Sequence) -> None:
        source, rid, index = self.where.pop(seq.id)
        if source is None:
            return
        if seq.finish_reason == "error":
            msg = Error(rid=rid, index=index, status=500, message=seq.error or "failed")
        else:
            reason = seq.finish_reason or "stop"  # set before on_done runs
            msg = Finish(rid=rid, index=index, reason=reason, tokens=len(seq.tokens))
        self.ch.send(msg, source)
        seqs = self.requests.get((source, rid), [])
        if all(s.finish_reason is not None for s in seqs):
            self.requests.pop((source, rid), None)


def run_engine(
    settings: EngineSettings,
    *,
    model_dir: str | Path,
    device: str,
    channel: str,
    api_servers: int,
    api_pid: int | None,
) -> None:
    """Serve mode inside the MPI job: every rank calls this; stage 0 runs the engine."""
    with mpi_pipeline(settings, model_dir, device=device, api_servers=api_servers) as pipe:
        if not pipe.topo.is_main:
            # Ctrl-C reaches every rank; only stage 0 acts on it, and stops the others in order.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not run_workers(pipe):
            return
        with Channel(channel, api_servers) as ch:
            Engine(pipe, settings, ch, api_pid=api_pid).run()
            stats = pipe.stage0.stop()
        log.info("engine stopped; per-stage time: %s", json.dumps(stats))
