"""The data and model stages killed with SIGKILL at random moments: after every kill each output
is either absent or complete (identical to an uninterrupted run's), and a rerun finishes with no
leftovers of the killed writes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distlm.dag.config import validate_config
from distlm.data import TokenBlocks, load_tokenizer
from distlm.data import read_tokens_meta as read_data_meta
from distlm.model import load_model_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "tiny.yaml"

STAGES = """
import json, sys
from pathlib import Path
from distlm.data import prepare
from distlm.core.log import setup_logging
from distlm.model import serialize
setup_logging()
from distlm.settings import Settings
from distlm.settings.model import ModelConfig
cfg = Settings.model_validate(json.loads(Path(sys.argv[1]).read_text()))
out = Path(sys.argv[2])
print("prepare", flush=True)  # imports done: the data stage starts (the test times kills from here)
prepare(cfg.data, cfg.model, tokens_path=out / "data" / "tokens.h5", tokenizer_dir=out / "data" / "tokenizer",
        stats_path=out / "data" / "stats.json")
serialize(ModelConfig.of({"model": cfg.model.model_dump(mode="json")}), tokenizer_dir=out / "data" / "tokenizer", tokens_path=out / "data" / "tokens.h5",
          out_dir=out / "model" / "base")
"""


def _start(cfg_path: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", STAGES, str(cfg_path), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _started(job: subprocess.Popen) -> float:
    """Wait for the stages' start line (imports done); when it came (time.monotonic())."""
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line == "prepare\n", (line, job.stderr.read()[-3000:] if job.stderr else "")
    return time.monotonic()


def _snapshot(out: Path) -> dict:
    """What each output that exists holds (opening it fails loudly if it is partial)."""
    snap = {}
    tokens = out / "data" / "tokens.h5"
    if tokens.exists():
        meta = read_data_meta(tokens)
        snap["tokens"] = (
            meta.config_digest,
            meta.vocab_size,
            *(TokenBlocks(tokens, s).tokens().tobytes() for s in ("train", "validation", "test")),
        )
    tok = out / "data" / "tokenizer"
    if tok.exists():
        load_tokenizer(tok)
        snap["tokenizer"] = {p.name: p.read_bytes() for p in sorted(tok.iterdir())}
    stats = out / "data" / "stats.json"
    if stats.exists():
        doc = json.loads(stats.read_text())
        doc.pop("seconds")
        for shard in doc["shards"]:  # what its job measured of itself
            for k in ("seconds", "tokens_per_s", "peak_rss_mb"):
                shard.pop(k)
        snap["stats"] = doc
    model = out / "model" / "base"
    if model.exists():
        load_model_dir(model)  # verifies the weights' sha256
        snap["model"] = (model / "model.safetensors").read_bytes()
    return snap


@pytest.mark.slow
def test_data_and_model_stages_killed_anywhere(tmp_path):
    cfg = validate_config(yaml.safe_load(TINY.read_text()))
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))

    ref = _start(cfg_path, tmp_path / "ref")
    t0, wall0 = _started(ref), time.time()
    assert ref.wait(timeout=300) == 0, ref.stderr.read()[-3000:]
    span = time.monotonic() - t0
    # how long the data stage took after the imports (stats.json is its last write): the first
    # kill falls in its first half, counted from the attempt's own start line, the others
    # anywhere, so the kills cover both stages however loaded the machine and however long its
    # imports take (timed from the process's start, a slow reference run once put the first kill
    # after a fast attempt had finished both stages)
    data_s = max(0.1, (tmp_path / "ref/data/stats.json").stat().st_mtime - wall0)
    want = _snapshot(tmp_path / "ref")
    assert set(want) == {"tokens", "tokenizer", "stats", "model"}

    out = tmp_path / "killed"
    rng = random.Random(5)
    seen: set[frozenset] = set()
    for i in range(8):
        job = _start(cfg_path, out)
        _started(job)
        time.sleep(rng.uniform(0.0, data_s / 2) if i == 0 else rng.uniform(0.0, span))
        if job.poll() is None:
            os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        got = _snapshot(out)
        for k, v in got.items():
            assert v == want[k], f"{k} after a kill differs from the uninterrupted run's"
        if "stats" in got:  # written last: its presence means the data stage is complete
            assert {"tokens", "tokenizer"} <= set(got)
        seen.add(frozenset(got))
    last = _start(cfg_path, out)
    assert last.wait(timeout=300) == 0, last.stderr.read()[-3000:]
    assert _snapshot(out) == want
    dotfiles = [
        p for d in (out / "data", out / "model") for p in d.iterdir() if p.name.startswith(".")
    ]
    assert dotfiles == []
    assert len(seen) >= 2  # the kills fell at different points of the stages
