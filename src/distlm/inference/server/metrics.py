"""The API server's Prometheus series, fed by requests and the engine's Health.

The supervisor starts the API server processes with PROMETHEUS_MULTIPROC_DIR (MULTIPROC_ENV) set
to a private folder: each process writes its values there, and `/metrics` in any of them gives
the sums over all of them (prometheus_client's multiprocess mode, as gunicorn deployments run
it). Counters and histograms add up; the engine's gauges (queue, lanes, stages), which every
process hears alike, show the most recent value; the open sequences add up over the processes
alive.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from distlm.inference.messages import Health

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported


def exposition() -> bytes:
    """/metrics: the series of every API server process (each writes them to MULTIPROC_ENV's
    folder, which the supervisor sets before starting it)."""
    folder = os.environ.get(MULTIPROC_ENV)
    if not folder:
        raise RuntimeError(f"{MULTIPROC_ENV} is not set: the supervisor starts API processes")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, folder)
    return generate_latest(registry)


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

    def health(self, h: Health) -> None:
        self.queue.set(h.waiting)
        self.lanes.set(h.lanes_busy)
        for st in h.stages:
            self.compute.labels(str(st.stage)).set(st.compute_s)
            self.wait.labels(str(st.stage)).set(st.recv_wait_s)
            self.cache.labels(str(st.stage)).set(st.cache_bytes)
            self.device.labels(str(st.stage)).set(st.device_s)
            self.steps.labels(str(st.stage)).set(st.micro_batches)
