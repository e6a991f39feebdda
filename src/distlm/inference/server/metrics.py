"""The API server's Prometheus series, fed by requests and the engine's Health.

The supervisor starts the API server processes with PROMETHEUS_MULTIPROC_DIR (MULTIPROC_ENV) set
to a private folder: each process writes its values there, and `/metrics` in any of them gives
the sums over all of them (prometheus_client's multiprocess mode, as gunicorn deployments run
it). Counters and histograms add up; the engine's gauges (queue, lanes, stages), which every
process hears alike, show the most recent value; the open sequences add up over the processes
alive.

What requests and tokens add (`count`, `observe`, `open_sequences`) is gathered in the process and
written at most FLUSH_S later, and before this process answers /metrics (`flush`): a write to the
shared folder is a locked mmap update, and one per token and request per series was a tenth of the
API server's CPU at 64 clients (docs/performance.md). Another process's /metrics sees a request
at most FLUSH_S after its answer went out.
"""

from __future__ import annotations

import asyncio
import os
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from distlm.inference.messages import Health

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported
FLUSH_S = 0.1  # how long what requests and tokens add waits to be written, at most


def exposition() -> bytes:
    """/metrics: the series of every API server process (each writes them to MULTIPROC_ENV's
    folder, which the supervisor sets before starting it)."""
    folder = os.environ.get(MULTIPROC_ENV)
    if not folder:
        raise RuntimeError(f"{MULTIPROC_ENV} is not set: the supervisor starts API processes")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, folder)
    return generate_latest(registry)


def observe_many(h: Histogram, values: list[float]) -> None:
    """`values` observed as `h.observe` observes them one by one (each in the first bucket whose
    bound it does not exceed), each bucket's count and the sum written once."""
    if not values:
        return
    bounds = h._upper_bounds  # prometheus_client's Histogram: the bounds, +Inf last
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    h._sum.inc(sum(values))
    for bucket, k in zip(h._buckets, counts, strict=True):
        if k:
            bucket.inc(k)


class Metrics:
    """The Prometheus series of one API server process (its own registry; the values go to the
    shared folder, see `exposition`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter(
            "distlm_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "distlm_time_to_first_token_seconds",
            "Completion requests: time to the first token",
            buckets=latency,
            registry=r,
        )
        self.itl = Histogram(
            "distlm_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=latency,
            registry=r,
        )
        self.e2e = Histogram(
            "distlm_e2e_request_latency_seconds",
            "Completion requests: time from arrival to the last token",
            buckets=latency,
            registry=r,
        )
        self.tokens = Counter("distlm_generation_tokens", "Tokens generated", registry=r)
        # what was added since the last flush: per counter (or labelled child), per histogram,
        # the open sequences' count; a labelled series' children by their labels
        self._counts: dict[Counter, float] = {}
        self._observed: dict[Histogram, list[float]] = {}
        self._open: int | None = None
        self._flushing: asyncio.TimerHandle | None = None
        self._children: dict[tuple, Counter] = {}
        self.prompt_tokens = Counter("distlm_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.sequences = Counter(
            "distlm_sequences", "Sequences ended, by finish reason", ["reason"], registry=r
        )
        self.updates = Counter(
            "distlm_weight_updates",
            "Weight updates asked for, by outcome (switched, unchanged, failed, timeout)",
            ["outcome"],
            registry=r,
        )
        self.update_seconds = Histogram(
            "distlm_weight_update_seconds",
            "Weight updates that switched: from the request to every stage serving the new weights",
            buckets=latency,
            registry=r,
        )

        def engine(name: str, doc: str, *labels: str) -> Gauge:
            """A gauge of the engine's word, which every API process hears alike (multiprocess
            mode: the most recent value)."""
            return Gauge(name, doc, list(labels), registry=r, multiprocess_mode="mostrecent")

        self.queue = engine("distlm_queue_depth", "Sequences waiting for a lane")
        self.lanes = engine("distlm_lanes_busy", "Pipeline lanes holding a sequence")
        self.up = Gauge(
            "distlm_engine_up",
            "1 while the pipeline answers",
            registry=r,
            multiprocess_mode="livemax",  # 1 while a live process hears stage 0
        )
        for gauge in (self.queue, self.lanes, self.up):  # shown before the first Health
            gauge.set(0)
        self.open = Gauge(
            "distlm_sequences_open",
            "Sequences submitted and not yet ended",
            registry=r,
            multiprocess_mode="livesum",  # each process's own, over the processes alive
        )
        self.compute = engine(
            "distlm_stage_compute_seconds", "Forward-pass seconds per stage", "stage"
        )
        self.cache = engine(
            "distlm_stage_kv_cache_bytes",
            "Bytes of KV cache a stage holds (0 when no lane holds a sequence)",
            "stage",
        )
        self.wait = engine(
            "distlm_stage_wait_seconds", "Seconds a stage waited for its previous stage", "stage"
        )
        self.device = engine(
            "distlm_stage_device_seconds",
            "The device's seconds in a stage's forward passes (CUDA events; CPU: their wall time)",
            "stage",
        )
        self.steps = engine(
            "distlm_stage_micro_batches", "Micro-batches a stage has run (forward passes)", "stage"
        )

    def child(self, series: Counter, *labels: str) -> Counter:
        """A labelled counter's series for these labels (prometheus_client's `labels`, kept)."""
        key = (id(series), *labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = series.labels(*labels)
        return got

    def count(self, counter: Counter, n: float = 1) -> None:
        """Add `n` to a counter (or a labelled one's `child`), written at the next flush."""
        self._counts[counter] = self._counts.get(counter, 0) + n
        self._due()

    def observe(self, histogram: Histogram, value: float) -> None:
        """Observe `value` in a histogram, written at the next flush."""
        got = self._observed.get(histogram)
        if got is None:
            self._observed[histogram] = [value]
        else:
            got.append(value)
        self._due()

    def open_sequences(self, n: int) -> None:
        """The sequences this process has submitted and not seen end, as of now."""
        self._open = n
        self._due()

    def _due(self) -> None:
        if self._flushing is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the event loop: at once
            self.flush()
            return
        self._flushing = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """What was added since the last flush, written."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        counts, self._counts = self._counts, {}
        for counter, n in counts.items():
            counter.inc(n)
        observed, self._observed = self._observed, {}
        for histogram, values in observed.items():
            observe_many(histogram, values)
        if self._open is not None:
            self.open.set(self._open)
            self._open = None

    def health(self, h: Health) -> None:
        self.queue.set(h.waiting)
        self.lanes.set(h.lanes_busy)
        for st in h.stages:
            self.compute.labels(str(st.stage)).set(st.compute_s)
            self.wait.labels(str(st.stage)).set(st.recv_wait_s)
            self.cache.labels(str(st.stage)).set(st.cache_bytes)
            self.device.labels(str(st.stage)).set(st.device_s)
            self.steps.labels(str(st.stage)).set(st.micro_batches)
