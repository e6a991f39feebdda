"""Optional torch.profiler over a window of steps (wait, warmup, active), per rank.

Exports, for each rank, a Chrome/Perfetto trace (`trace-rank{r}.json`, open in ui.perfetto.dev or
chrome://tracing) and the top operators by self time (`top-ops-rank{r}.csv` and `.json`), which the
report stage reads; the JSON also holds the step's phases (the trainer's `distlm.*` ranges: data,
forward, backward with DDP's all-reduce, clip, optimizer), CPU and device time a call. Both are
written when the training loop ends, never inside a timed step. Rank
0 writes `profile.json` (a ProfileSummary document): whether profiling was on, and whether a window
was captured. The top-ops tables are data files (tables, like
metrics.csv), not versioned documents.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Self

from distlm.core.documents import write_document
from distlm.core.io import atomic_path, write_json, write_text
from distlm.core.log import get_logger
from distlm.runtime.device import DeviceBackend
from distlm.settings import ProfileSettings
from distlm.train.documents import ProfileSummary, ProfileWindow

log = get_logger(__name__)


def phases(prof) -> list[dict]:
    """The trainer's step phases (record_function ranges named `distlm.*`): time a call."""
    out = []
    for e in prof.key_averages():
        if e.key.startswith("distlm."):
            n = max(1, int(e.count))
            out.append(
                {
                    "name": e.key,
                    "calls": int(e.count),
                    "cpu_us_per_call": round(float(e.cpu_time_total) / n, 1),
                    "device_us_per_call": round(float(getattr(e, "device_time_total", 0.0)) / n, 1),
                }
            )
    return out


def top_ops(prof, *, on_gpu: bool, limit: int) -> list[dict]:
    """The `limit` operators with the largest self time (device time on GPUs, CPU time otherwise)."""
    rows = []
    for e in prof.key_averages():
        self_dev = getattr(e, "self_device_time_total", 0.0) if on_gpu else 0.0
        rows.append(
            {
                "name": e.key,
                "calls": int(e.count),
                "self_cpu_us": float(e.self_cpu_time_total),
                "cpu_total_us": float(e.cpu_time_total),
                "self_device_us": float(self_dev),
                "device_total_us": float(getattr(e, "device_time_total", 0.0)) if on_gpu else 0.0,
            }
        )
    key = "self_device_us" if on_gpu else "self_cpu_us"
    rows.sort(key=lambda r: r[key], reverse=True)
    total = sum(r[key] for r in rows) or 1.0
    for r in rows:
        r["self_pct"] = round(100.0 * r[key] / total, 3)
    return rows[:limit]


class StepProfiler:
    """Context manager around the training loop; call `step()` after every optimizer step."""

    def __init__(
        self,
        cfg: ProfileSettings,
        *,
        out_dir: Path,
        rank: int,
        hw: DeviceBackend,
        start_step: int,
    ) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.hw = hw
        self.start_step = start_step
        self._prof = None
        self._ready = None  # the profiler whose window is complete, until __exit__ exports it
        self.exported = False

    def _on_ready(self, prof) -> None:
        # The window is held and written when the loop ends (__exit__): exporting here put ~0.7 s
        # of JSON writing into the next step's time, a step the training loop waited for.
        self._ready = prof

    def _export(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace-rank{self.rank}.json"
        with atomic_path(trace) as tmp:
            prof.export_chrome_trace(str(tmp))
        rows = top_ops(prof, on_gpu=self.hw.is_gpu, limit=self.cfg.top_ops)
        window = self.cfg.model_dump(include={"wait", "warmup", "active"})
        write_json(
            self.out_dir / f"top-ops-rank{self.rank}.json",
            {
                "rank": self.rank,
                "device": str(self.hw.device),
                "first_step": self.start_step + 1,
                "window": window,
                "sort_by": "self_device_us" if self.hw.is_gpu else "self_cpu_us",
                "ops": rows,
                "phases": phases(prof),
            },
        )
        cols = [
            "name",
            "calls",
            "self_cpu_us",
            "cpu_total_us",
            "self_device_us",
            "device_total_us",
            "self_pct",
        ]
        lines = [",".join(cols)] + [
            ",".join(
                '"' + str(r[c]).replace('"', '""') + '"' if c == "name" else str(r[c]) for c in cols
            )
            for r in rows
        ]
        write_text(self.out_dir / f"top-ops-rank{self.rank}.csv", "\n".join(lines) + "\n")
        self.exported = True
        log.info("profiler: wrote %s and the top %d operators by self time", trace, len(rows))

    def __enter__(self) -> Self:
        if not self.cfg.enabled:
            return self
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.hw.is_gpu else [])
        self._prof = profile(
            activities=acts,
            schedule=schedule(
                wait=self.cfg.wait,
                warmup=self.cfg.warmup,
                active=self.cfg.active,
                repeat=1,
            ),
            on_trace_ready=self._on_ready,
            record_shapes=False,
            with_stack=False,
        )
        self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            with contextlib.suppress(Exception) if exc[0] is not None else contextlib.nullcontext():
                self._prof.__exit__(*exc)
                if self._ready is not None:  # also on a stop or an error: the window happened
                    self._export(self._ready)
            self._prof = self._ready = None

    def write_summary(self, steps_run: int) -> None:
        """Rank 0: record in profile.json whether a window was captured, and why not if not."""
        needed = self.cfg.wait + self.cfg.warmup + self.cfg.active
        window = ProfileWindow.model_validate(
            self.cfg.model_dump(include={"wait", "warmup", "active"})
        )
        on = self.cfg.enabled
        info = ProfileSummary(
            enabled=on,
            window=window,
            captured=self.exported if on else None,
            first_step=self.start_step + 1 if on else None,
            reason=f"the run had {steps_run} steps after its start, the window needs {needed}"
            if on and not self.exported
            else None,
        )
        write_document(self.out_dir / "profile.json", info)
