"""A live update of the served weights: every stage stages its part of the new weights beside the
ones it serves, then all switch between the same two micro-batches, or none does.

    API process --Update--> stage 0 (its channel)
    stage 0 checks the source: a folder (distlm.model.weights: its documents, its tensors' names,
        the architecture) or a sender's offer (distlm.transfer.push: the training ranks'), starts
        staging its own part and sends Prepare round the ring
    each stage stages in a thread (the memory counted first; from a folder: its files' sha256,
        its tensors read; from a push: its own tensors asked of the sender and received, checked
        by name, shape and dtype and by the chunks' checksums; then shapes checked, built on its
        device); its word (Prepared) rides the next message past it
    all staged: the policy. `wait`: no request starts; the running ones end on the old weights.
        `abort`: the running requests end now, finish reason "abort". No sequence is ever
        produced by two sets of weights.
    no sequence left: stage 0 copies its part in, sends Swap round (each stage copies its part in
        when the message reaches it, so every micro-batch runs on one set of weights) and tells
        every API process the new weights (Ready); requests start again
    any stage failed: Swap(commit=False) round, each stage drops what it staged; the old weights
        serve on, and the API process that asked hears why
    the Swap back at stage 0: the API process that asked hears Updated

The parameters are written in place (`Transformer.load_staged`), so what holds them (a CUDA graph
of the decode step) sees the new values; a stage's staging costs a second copy of its weights
while it lasts. A stage that dies meanwhile ends the job, as at any other time: no server answers
from a mix of weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.inference.engine.pipeline_stage import StageModel
from distlm.inference.engine.ring import Prepare, Prepared, Swap
from distlm.inference.engine.weight_sources import FromDisk, FromPush, Source
from distlm.inference.messages import Policy, Stall, Update
from distlm.model.weights import args_of, weight_files
from distlm.runtime.device import free_bytes, stream_synchronize

log = get_logger(__name__)

ABORT = "abort"  # policy abort, and the finish reason of the sequences it ends
_MEMORY_MARGIN = 256 << 20  # what staging leaves free on the device, beyond its own need


class NewWeights:
    """One stage's part of update `update`, staged in a thread: `word` is its Prepared once done."""

    def __init__(self, model: StageModel, msg: Prepare) -> None:
        self.model, self.update = model, msg.update
        self.staged: dict | None = None
        self.word: Prepared | None = None
        self.told = False  # its word went to stage 0
        self._thread = threading.Thread(
            target=self._run,
            args=(msg.source, msg.tied, msg.stages),
            name=f"staging-{msg.update}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, source: Source, tied: dict[str, str], stages: int) -> None:
        t0 = time.perf_counter()
        m = self.model
        where = f"stage {m.stage}"
        try:
            mine = m.blocks.hf_tensors()
            need = sum(p.numel() * p.element_size() for p in m.blocks.parameters())
            need += source.landing_bytes(mine, tied, m.device)  # as they arrive, beside the copy
            free = free_bytes(m.device)
            if need + _MEMORY_MARGIN > free:
                raise DistlmError(
                    f"{where}: staging needs {need / 1e6:.0f} MB beside the served weights on "
                    f"{m.device}, {free / 1e6:.0f} MB are free"
                )
            tensors = source.read(mine, tied, stage=m.stage, stages=stages, device=m.device)
            self.staged = m.blocks.staged_hf(tensors, f"{source.label} ({where})")
            stream_synchronize(m.device)
            error = None
        except DistlmError as e:
            error = str(e)
        except Exception as e:  # a bug must not hang the update: it fails, and says so
            log.exception("%s: staging update %d failed", where, self.update)
            error = f"{where}: {type(e).__name__}: {e}"
        nbytes = sum(t.numel() * t.element_size() for t in (self.staged or {}).values())
        if error is not None:
            self.staged = None
            log.warning("%s: update %d not staged: %s", where, self.update, error)
        self.word = Prepared(self.update, m.stage, error, nbytes, time.perf_counter() - t0)

    def done(self) -> bool:
        return self.word is not None

    def take_word(self) -> Prepared | None:
        """Its word, once, when done (what rides the next message past this stage)."""
        if self.word is None or self.told:
            return None
        self.told = True
        return self.word

    def finish(self, msg: Swap) -> None:
        """Switch to the staged weights (commit), or drop them."""
        if msg.update != self.update:
            raise DistlmError(
                f"stage {self.model.stage}: Swap of update {msg.update}, staged {self.update}"
            )
        if msg.commit:
            self._thread.join()
            if self.staged is None:
                raise DistlmError(
                    f"stage {self.model.stage}: told to switch to update {msg.update}, "
                    "which it did not stage"
                )
            self.model.blocks.load_staged(self.staged)
            # the copies in are done before the next step (the stall's figure is the device's
            # too, not the time to queue them)
            stream_synchronize(self.model.device)
            log.info("stage %d: now serving update %d", self.model.stage, msg.update)
        self.staged = None


@dataclass(frozen=True)
class Outcome:
    """How an update ended: what stage 0 tells the API process that asked, and /health."""

    update: int
    status: int  # 200, 400 (refused, or not staged), 409 (another update is in progress)
    message: str
    source: str
    kind: str
    weights: str  # the weights served after it
    seconds: float
    bytes: int
    changed: bool
    stall: Stall = field(default_factory=Stall)


class Updater:
    """Stage 0's side of updates, one at a time; the engine calls `begin` for an Update and
    `poll` before each step. `ring_send` sends a Prepare or Swap round the ring (None: a
    one-stage pipeline); `hold(on)` closes or opens the scheduler's admission gate;
    `cancel_open()` ends the running requests (policy abort); `idle()` whether no sequence
    runs; `switched(weights)` records the weights now served; `done(outcome, to)` tells the API
    processes (the new weights to all, the outcome to the one that asked)."""

    def __init__(
        self,
        model: StageModel,
        *,
        stages: int,
        tied: dict[str, str],
        expected: set[str],
        ring_send: Callable[[Prepare | Swap], None] | None,
        hold: Callable[[bool], None],
        cancel_open: Callable[[], None],
        idle: Callable[[], bool],
        switched: Callable[[str], None],
        done: Callable[[Outcome, tuple[int, int]], None],
    ) -> None:
        self.model, self.stages, self.tied, self.expected = model, stages, tied, expected
        self.ring_send, self.hold, self.cancel_open, self.idle = ring_send, hold, cancel_open, idle
        self.switched, self.done = switched, done
        self.n = 0
        self.run: _Run | None = None

    @property
    def busy(self) -> bool:
        return self.run is not None

    def begin(self, to: tuple[int, int], msg: Update, weights: str) -> Outcome | None:
        """Start update `msg` for the request `to` (channel, rid); an Outcome at once when it
        cannot start (another is running, the source is refused, or it holds the weights
        served)."""
        self.n += 1
        t0 = time.perf_counter()
        label = msg.push.where if msg.push is not None else msg.path

        def refused(message: str, *, kind: str = "", status: int = 400) -> Outcome:
            return Outcome(
                self.n,
                status,
                message,
                label,
                kind,
                weights,
                time.perf_counter() - t0,
                0,
                False,
            )

        if self.run is not None:
            return refused(f"update {self.run.update} is in progress; one at a time", status=409)
        src: Source
        try:
            if msg.push is not None:  # each stage checks its part's names, shapes and dtypes
                src = FromPush(msg.push)
                self._same_architecture(msg.push.architecture, src.label)
            else:
                files = weight_files(msg.path)
                files.check_names(self.expected, self.tied)
                args = args_of(files)
                if args is not None:
                    self._same_architecture(args.signature(), str(files.config))
                src = FromDisk(files)
        except DistlmError as e:
            return refused(str(e))
        if src.digest == weights:
            return refused("these weights are already served", kind=src.kind, status=200)
        prepare = Prepare(self.n, src, self.tied, self.stages)
        self.run = _Run(self.n, to, src, msg.policy, t0, weights)
        self.run.mine = NewWeights(self.model, prepare)
        if self.ring_send is not None:
            self.ring_send(prepare)
        log.info("update %d: staging %s (%s), policy %s", self.n, src.label, src.kind, msg.policy)
        return None

    def _same_architecture(self, theirs: dict, where: str) -> None:
        """`theirs` (a ModelArgs.signature(): config.json's, or the sender's) is the running
        model's; the error names the first key that differs."""
        mine = self.model.args.signature()
        diff = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        if diff:
            k = diff[0]
            raise DistlmError(
                f"{where}: another architecture: {k} {theirs.get(k)!r}, the running model's "
                f"{mine.get(k)!r}"
            )

    def heard(self, words) -> None:
        """Stages' words on their staging (from the ring)."""
        if self.run is None:
            return
        for w in words:
            if w.update == self.run.update:
                self.run.words[w.stage] = w

    def poll(self) -> bool:
        """Advance the update; True when it wants the ring to carry stages' words now (the
        engine sends an empty micro-batch when none is in flight)."""
        r = self.run
        if r is None:
            return False
        if r.phase == "staging":
            w = r.mine.take_word() if r.mine is not None else None
            if w is not None:
                r.words[w.stage] = w
            if len(r.words) < self.stages:
                return True
            failed = [w for w in r.words.values() if w.error is not None]
            if failed:
                self._swap(r, commit=False, why=failed[0].error or "")
                return False
            r.phase = "draining"
            self.hold(True)
            r.held_at = time.perf_counter()
            if r.policy == ABORT:
                self.cancel_open()
        if r.phase == "draining" and self.idle():
            r.idle_at = time.perf_counter()
            self._swap(r, commit=True)
        if r.phase == "switching" and (self.ring_send is None or r.echoed):
            self._end(r)
        return False

    def echoed(self, msg: Prepare | Swap) -> None:
        """An update's message came back round the ring; a Swap: every stage has done it."""
        if isinstance(msg, Swap) and self.run is not None and msg.update == self.run.update:
            self.run.echoed = True
            self.run.switched_at = time.perf_counter()
            self.poll()

    def _swap(self, r: _Run, *, commit: bool, why: str = "") -> None:
        msg = Swap(r.update, commit)
        if r.mine is not None:
            r.mine.finish(msg)
        if self.ring_send is not None:
            self.ring_send(msg)
        r.phase, r.commit, r.why = "switching", commit, why
        if commit:
            self.switched(r.src.digest)
        self.hold(False)
        r.released_at = r.switched_at = time.perf_counter()  # a ring's: when the Swap is back
        if self.ring_send is None:
            self._end(r)

    def _end(self, r: _Run) -> None:
        self.run = None
        nbytes = sum(w.bytes for w in r.words.values())
        seconds = time.perf_counter() - r.t0
        if r.commit:
            msg = f"now serving {r.src.label} ({r.src.kind})"
            log.info("update %d: %s in %.3f s, %.1f MB", r.update, msg, seconds, nbytes / 1e6)
        else:
            msg = f"not updated, the served weights are unchanged: {r.why}"
            log.warning("update %d: %s", r.update, msg)
        self.done(
            Outcome(
                r.update,
                200 if r.commit else 400,
                msg,
                r.src.label,
                r.src.kind,
                r.src.digest if r.commit else r.served,
                seconds,
                nbytes if r.commit else 0,
                r.commit,
                r.stall(),
            ),
            r.to,
        )


class _Run:
    """One update in flight, at stage 0."""

    def __init__(
        self,
        update: int,
        to: tuple[int, int],
        src: Source,
        policy: Policy,
        t0: float,
        served: str,
    ) -> None:
        self.update, self.to, self.src, self.policy, self.t0 = update, to, src, policy, t0
        self.served = served  # the weights before it
        self.mine: NewWeights | None = None
        self.words: dict[int, Prepared] = {}
        self.phase = "staging"  # -> draining -> switching
        self.commit = False
        self.echoed = False
        self.why = ""
        # perf_counter: new requests held, no sequence running, the gate open, every stage switched
        self.held_at = self.idle_at = self.released_at = self.switched_at = 0.0

    def stall(self) -> Stall:
        """What it cost the requests (messages.Stall); nothing when it did not switch."""
        if not self.commit:
            return Stall()
        return Stall(
            held_s=round(self.released_at - self.held_at, 6),
            switch_s=round(self.switched_at - self.idle_at, 6),
        )
