"""The serving peer users would pick instead of distlm: `transformers serve`, started on a folder.

    transformers serve results/train/final --continuous-batching --device cpu --port 8000

`transformers serve` ships with the transformers distlm depends on: FastAPI/uvicorn with
OpenAI's `/v1/completions`, paged attention and continuous batching. The benchmark
(benchmarks/inference/bench_serve.py) measures distlm against it and the tests check that it loads
the folders distlm writes unchanged. It loads a model with `device_map`, so it needs `accelerate`
(the test and bench extras carry it). Readiness is `/health` (its `/v1/models` scans the hub cache).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distlm import DistlmError


def transformers_serve_command(
    model_dir: str | Path, *, port: int, host: str = "127.0.0.1", continuous_batching: bool = True
) -> list[str]:
    """argv of `transformers serve` preloading `model_dir` on the CPU."""
    exe = shutil.which("transformers")
    if exe is None:
        raise DistlmError("`transformers` command not found: transformers >= 5.8 ships it")
    cmd = [exe, "serve", str(model_dir), "--device", "cpu", "--host", host, "--port", str(port)]
    if continuous_batching:
        cmd.append("--continuous-batching")
    return cmd


def transformers_serve_env(threads: int) -> dict[str, str]:
    """Its environment: offline (nothing can be fetched here) and `threads` torch threads."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
