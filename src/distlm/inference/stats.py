"""What a stage reports about itself: where it runs (StageInfo), where its time went (StageStats),
and the brief of those figures that rides on the ring and feeds /metrics (StageBrief).

Plain typed records, free of torch: the ring, the engine channel and the API server share them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pydantic import ConfigDict


@dataclass(frozen=True)
class StageInfo:
    """Where one stage runs: the Hello round at start collects one per stage."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # as an engine-channel field

    stage: int
    host: str
    pid: int
    layers: tuple[int, int]  # [start, end) of the model's blocks
    threads: int
    device: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclass(frozen=True)
class StageBrief:
    """A stage's cumulative seconds, as /metrics shows them (each Work message carries them)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # as an engine-channel field

    stage: int
    compute_s: float
    send_s: float
    recv_wait_s: float
    cache_bytes: int = 0  # the KV cache the stage holds now (0 when every lane is free)
    device_s: float = 0.0  # the device's time in the forward passes (StageStats.device_s)
    micro_batches: int = 0


@dataclass
class StageStats:
    """Where a stage's time went: forward passes, sends, and waiting for the previous stage.

    `compute_s` is the host's wall time around the forward passes (sampling on the last stage
    included); `device_s` the device's own time in them (runtime.device's DeviceClock: CUDA
    events on a GPU; on the CPU the same spans' wall time)."""

    stage: int
    compute_s: float = 0.0
    device_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    micro_batches: int = 0
    items: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    cache_bytes: int = 0  # the KV cache held now

    def reset(self) -> None:
        self.__init__(stage=self.stage)

    def brief(self) -> StageBrief:
        """What /metrics shows per stage (cumulative seconds)."""
        return StageBrief(
            self.stage,
            self.compute_s,
            self.send_s,
            self.recv_wait_s,
            self.cache_bytes,
            self.device_s,
            self.micro_batches,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["comm_s"] = self.send_s + self.recv_wait_s
        return d
