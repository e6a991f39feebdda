"""The API server's Prometheus series (its own registry), fed by requests and the engine's Health."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from distlm.inference.messages import Health


class Metrics:
    """The Prometheus series of one API server (its own registry)."""

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
        self.queue = Gauge("distlm_queue_depth", "Sequences waiting for a lane", registry=r)
        self.lanes = Gauge("distlm_lanes_busy", "Pipeline lanes holding a sequence", registry=r)
        self.open = Gauge(
            "distlm_sequences_open", "Sequences submitted and not yet ended", registry=r
        )
        self.up = Gauge("distlm_engine_up", "1 while the pipeline answers", registry=r)
        self.compute = Gauge(
            "distlm_stage_compute_seconds", "Forward-pass seconds per stage", ["stage"], registry=r
        )
        self.cache = Gauge(
            "distlm_stage_kv_cache_bytes",
            "Bytes of KV cache a stage holds (0 when no lane holds a sequence)",
            ["stage"],
            registry=r,
        )
        self.wait = Gauge(
            "distlm_stage_wait_seconds",
            "Seconds a stage waited for its previous stage",
            ["stage"],
            registry=r,
        )

    def health(self, h: Health) -> None:
        self.queue.set(h.waiting)
        self.lanes.set(h.lanes_busy)
        for st in h.stages:
            self.compute.labels(str(st.stage)).set(st.compute_s)
            self.wait.labels(str(st.stage)).set(st.recv_wait_s)
            self.cache.labels(str(st.stage)).set(st.cache_bytes)
