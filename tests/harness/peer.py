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
    model_dir: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    continuous_batching: bool = True,
    kv_blocks: int | None = None,
    device: str = "cpu",
) -> list[str]:
    """argv of `transformers serve` preloading `model_dir` on `device`. `kv_blocks`: the paged KV
    cache's size in blocks (`--cb-num-blocks`); by default continuous batching sizes it from the
    memory it finds, and on the CPU its first request then spends ~26-30 s of a core (system time)
    setting up a cache of gigabytes before it answers (measured on the 2-core VM with the tests'
    Llama folder; with 32 blocks the first answer takes 0.2 s)."""
    exe = shutil.which("transformers")
    if exe is None:
        raise DistlmError("`transformers` command not found: transformers >= 5.8 ships it")
    cmd = [exe, "serve", str(model_dir), "--device", device, "--host", host, "--port", str(port)]
    if continuous_batching:
        cmd.append("--continuous-batching")
        if kv_blocks is not None:
            cmd += ["--cb-num-blocks", str(kv_blocks)]
    return cmd


def transformers_serve_env(threads: int) -> dict[str, str]:
    """Its environment: offline (nothing can be fetched here) and `threads` torch threads."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
