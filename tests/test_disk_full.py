"""A full disk (ENOSPC) during a write: the partial files go, what was there before stays as it
was, the error names the path, the bytes needed and the bytes free, and once space is freed the
same command goes on from the last good checkpoint.

The disk is a real small file system (tmpfs with a size limit) mounted where the write lands, so
the writers fail the way they do on a full scratch space: safetensors, torch.save, h5py and plain
writes each report it in their own way. Mounting needs root (CI runs as root)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import SINGLE, TINY, copy_workflow, run_snakemake
from harness.synthetic import checkpoint_state, write_tokens

from distlm.core.io import DiskFull, atomic_path, free_bytes, nbytes, write_text
from distlm.dag.config import deep_merge
from distlm.runtime.device import DeviceBackend

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None or shutil.which("umount") is None,
    reason="mounting a small file system needs root and mount/umount (CI runs as root)",
)


@contextlib.contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `where` (created), unmounted on every exit path."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "distlm-test", str(where)],
        check=True,
    )
    try:
        yield where
    finally:
        gc.collect()  # tensors mapped from files on it (safetensors loads by mmap) let go
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)


def fill(fs: Path, leave: int) -> Path:
    """A filler file that leaves `leave` bytes free on `fs`; deleting it is freeing space."""
    filler = fs / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free_bytes(fs) - leave))
    return filler


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def assert_named(e: DiskFull, path: Path) -> None:
    """The message names the path, the bytes needed and the bytes free; `free` is what is free
    now (the partial files are gone) and too little for the write."""
    text = str(e)
    assert text.startswith(f"{path}: No space left on device"), text
    assert f"needs {e.needed} bytes" in text and f"{e.free} bytes" in text, text
    assert e.free == free_bytes(path.parent) and e.free < e.needed, text


# ----------------------------------------------------------------------------- each writer


def test_checkpoint_write_on_a_full_disk_keeps_the_previous_one(tmp_path):
    """torch.save (the optimizer state) runs out of space halfway through a checkpoint: the new
    folder is gone, the previous checkpoint verifies byte for byte, and once space is freed the
    same save succeeds and prunes the old one."""
    from distlm.train import checkpoint as ck

    weights = {"w": torch.randn(64 * 1024)}  # 256 KiB
    moments = {"exp_avg": torch.randn(64 * 1024), "exp_avg_sq": torch.randn(64 * 1024)}
    optimizer = {"state": {0: {**moments, "step": torch.tensor(1.0)}}, "param_groups": []}
    rng = [DeviceBackend.cpu().rng_state()]
    with tmpfs(tmp_path / "fs", 4 << 20) as fs:
        run = fs / "run"
        first = ck.write(
            run, weights=weights, optimizer_state=optimizer, rng_states=rng, state=checkpoint_state(1),
            keep_last=1,
        )  # fmt: skip
        before = digests(first)
        # Room for the weights (256 KiB) of the next one, not for its optimizer state (512 KiB).
        filler = fill(fs, 400 << 10)
        with pytest.raises(DiskFull) as got:
            ck.write(
                run, weights=weights, optimizer_state=optimizer, rng_states=rng, state=checkpoint_state(2),
                keep_last=1,
            )  # fmt: skip
        e = got.value
        assert_named(e, run / "step-00000002")
        assert e.needed == nbytes(weights) + nbytes(optimizer) + nbytes(rng)
        assert sorted(p.name for p in run.iterdir()) == ["step-00000001"]  # no partial files
        assert digests(first) == before
        ck._VERIFIED.clear()  # read it back from disk, not from this process's memory
        assert ck.latest_good(run) == ck.Checkpoint(first, 1)

        filler.unlink()  # space freed: the same write goes through, and the old one is pruned
        second = ck.write(
            run, weights=weights, optimizer_state=optimizer, rng_states=rng, state=checkpoint_state(2),
            keep_last=1,
        )  # fmt: skip
        assert sorted(p.name for p in run.iterdir()) == ["step-00000002"]
        assert torch.equal(ck.load_weights(ck.Checkpoint(second, 2))["w"], weights["w"])


def test_model_folder_and_shards_on_a_full_disk(tmp_path):
    """safetensors reports the full disk as its own error: a model folder and a pipeline folder
    written over existing ones leave them as they were."""
    from distlm.dag.config import validate_settings
    from distlm.data import prepare
    from distlm.model import serialize, write_pipeline_dir
    from distlm.settings.model import ModelConfig

    c = validate_settings(
        {
            "data": {"block_size": 32, "tokenizer": {"vocab_size": 300}},
            "model": {"init": {"n_layer": 4, "n_head": 2, "n_embd": 64, "n_positions": 64}},
        }
    )
    mcfg = ModelConfig.of({"model": c.model.model_dump(mode="json")})  # the rule's document
    data = tmp_path / "data"
    prepare(
        c.data,
        c.model,
        tokens_path=data / "tokens.h5",
        tokenizer_dir=data / "tokenizer",
        stats_path=data / "stats.json",
    )
    with tmpfs(tmp_path / "fs", 4 << 20) as fs:
        model, pipeline = fs / "model", fs / "pipeline"
        kw = {"tokenizer_dir": data / "tokenizer", "tokens_path": data / "tokens.h5"}
        serialize(mcfg, **kw, out_dir=model)
        write_pipeline_dir(model, pipeline, stages=2)
        model_before, shards_before = digests(model), digests(pipeline / "shards")
        weights = (model / "model.safetensors").stat().st_size

        filler = fill(fs, weights // 2)
        with pytest.raises(DiskFull) as got:
            serialize(mcfg, **kw, out_dir=model)
        assert_named(got.value, model)
        assert "os error 28" in str(got.value.__cause__)  # safetensors' own wording, recognised
        assert got.value.needed >= weights - 1024  # tensors' bytes, without the header
        with pytest.raises(DiskFull) as got:
            write_pipeline_dir(model, pipeline, stages=2)
        assert_named(got.value, pipeline)
        assert sorted(p.name for p in fs.iterdir()) == ["filler.bin", "model", "pipeline"]
        assert digests(model) == model_before and digests(pipeline / "shards") == shards_before

        filler.unlink()
        write_pipeline_dir(model, pipeline, stages=2)
        assert digests(pipeline / "shards") == shards_before


def test_token_shard_and_plain_writes_on_a_full_disk(tmp_path):
    """A token shard (its ids stream into scratch files, then into the HDF5 file) and plain
    writes; a write that declares no size says how much it had written when the space ran out.
    What was there before (a finished shard and its index) stays as it was."""
    import h5py

    from distlm.data.documents import TokenMeta

    meta = TokenMeta(
        source={}, config_digest="test", tokenizer="test", vocab_size=1000, eos_token_id=None,
        block_size=10,
    )  # fmt: skip

    def tree(fs: Path) -> dict[str, str]:
        return {
            str(p.relative_to(fs)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(fs.rglob("*"))
            if p.is_file()
        }

    with tmpfs(tmp_path / "fs", 1 << 20) as fs:
        tokens = fs / "tokens.h5"
        ids = np.arange(1000, dtype=np.int64) % 1000
        write_tokens(tokens, {"train": ids}, 10, 1000, meta)
        before = tree(fs)
        for n, estimated in ((600_000, False), (300_000, True)):
            # 1.2 MB of uint16 ids: the stream's scratch write runs out; 0.6 MB: the stream fits,
            # and the shard file's space is found short before HDF5 writes a byte of it
            other = meta.model_copy(update={"config_digest": f"test-{n}"})
            with pytest.raises(DiskFull) as got:
                write_tokens(fs / "other.h5", {"train": np.arange(n) % 1000}, 10, 1000, other)
            shard = got.value.path
            assert shard.parent == fs / "shards" and shard.suffix == ".h5"
            if estimated:
                assert_named(got.value, shard)
            else:
                text = str(got.value)
                assert text.startswith(f"{shard}: No space left on device"), text
                assert f"needs more than the {got.value.needed} bytes" in text, text
                assert f"{got.value.free} bytes" in text and got.value.needed > 0, text
            assert tree(fs) == before  # no scratch file, no partial shard, the first untouched
        with h5py.File(tokens) as f:
            assert f["train"].attrs["n_tokens"] == 1000

        with pytest.raises(DiskFull) as got:
            write_text(fs / "big.txt", "x" * (2 << 20))
        assert_named(got.value, fs / "big.txt")
        assert got.value.needed == 2 << 20
        with pytest.raises(DiskFull) as got, atomic_path(fs / "raw.bin") as tmp:
            tmp.write_bytes(b"x" * (2 << 20))
        assert "needs more than the" in str(got.value) and got.value.needed > 0
        assert tree(fs) == before


# ----------------------------------------------------------------------------- the workflow

# Three checkpoints of which two are kept: the third write finds the disk full.
DISK = {"train": {"max_steps": 12, "ckpt_every": 4, "eval_every": 4, "keep_last": 2}}


@pytest.mark.slow
@pytest.mark.with_slurm
def test_workflow_on_a_full_disk_resumes_once_space_is_freed(tmp_path, workflow_run):
    """The user's command on a scratch space that fills: the token file's write fails first (the
    data rule stops, nothing partial left); space freed, the same command runs until the third
    checkpoint's write fills the disk; training stops naming the path and the space, the two
    checkpoints before it unchanged; space freed, the same command resumes from the last good
    one and ends with final weights byte-identical to a run that never saw a full disk."""
    from distlm.train import checkpoint as ck

    conf = tmp_path / "tiny-disk.yaml"
    # one training rank (tiny-single.yaml): a checkpoint is written by rank 0 whatever the ranks
    tiny = deep_merge(*(yaml.safe_load(p.read_text()) for p in (TINY, SINGLE)))
    conf.write_text(yaml.safe_dump(deep_merge(tiny, DISK)))

    # the run that never saw a full disk: the session's tiny workflow (no train setting changes
    # its data or base model) trained afresh with DISK
    ref = copy_workflow(workflow_run, tmp_path / "ref", without=("results/train", "logs/train"))
    run_snakemake(ref, "train", configfile=conf)
    ref_run = _only_run(ref)
    ckpt_bytes = sum(p.stat().st_size for p in (ref_run / "step-00000012").iterdir())

    wd = tmp_path / "wd"
    with tmpfs(wd / "results" / "data", 256 << 10) as data:
        proc = run_snakemake(wd, "train", configfile=conf, check=False)
        assert proc.returncode != 0
        # the shard's tokenize job fills it: it had written as many bytes as were free
        shard = re.compile(r"results/data/shards/[0-9a-f]{16}\.h5")
        e = _disk_full_in(wd, "data", shard, proc.stdout + proc.stderr)
        assert e["needed"] >= e["free"]
        partial = [p for p in data.rglob(".*") if p.name != ".snakemake_timestamp"]
        assert not partial  # (the timestamp: Snakemake's mark of the tokenizer's finished folder)
        assert not list(data.rglob("*.h5"))
    # Space freed (here: a disk as large as it needs): the same command goes on.
    ckpts = wd / "results" / "train" / "checkpoints"
    with tmpfs(ckpts, 16 << 20) as fs:
        # Two checkpoints and a half: the third write (step 12) fills the disk.
        filler = fill(fs, int(2.5 * ckpt_bytes))
        proc = run_snakemake(wd, "train", configfile=conf, check=False)
        assert proc.returncode != 0
        (run,) = [p for p in fs.iterdir() if p.is_dir()]
        e = _disk_full_in(
            wd, "train", run.relative_to(wd) / "step-00000012", proc.stdout + proc.stderr
        )
        assert 0.95 * ckpt_bytes < e["needed"] <= ckpt_bytes and e["free"] < e["needed"]
        assert sorted(p.name for p in run.iterdir()) == [
            "identity.json",
            "step-00000004",
            "step-00000008",
        ]  # no partial folder; the lease went with the trainer
        kept = run / "step-00000008"  # the weights of the uninterrupted run's step 8
        mine, theirs = (ck.load_weights(ck.Checkpoint(r / kept.name, 8)) for r in (run, ref_run))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        ck._VERIFIED.clear()  # read back from disk
        ck.verify(ck.Checkpoint(kept, 8))
        assert (wd / "results/data/tokens.h5").read_bytes() == (
            ref / "results/data/tokens.h5"
        ).read_bytes()

        filler.unlink()
        run_snakemake(wd, "train", configfile=conf)
        log = _logs(wd, "train")
        assert f"resuming from {run.relative_to(wd)}/step-00000008 (step 8 of 12)" in log
        weights = "results/train/final/model.safetensors"
        assert (wd / weights).read_bytes() == (ref / weights).read_bytes()
        assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
            "step-00000008",
            "step-00000012",
        ]


def _only_run(wd: Path) -> Path:
    (run,) = [p for p in (wd / "results/train/checkpoints").iterdir() if p.is_dir()]
    return run


def _logs(wd: Path, stage: str) -> str:
    """Every log of a stage (the rule's and its ranks')."""
    return "".join(
        p.read_text(errors="replace") for p in sorted((wd / "logs" / stage).rglob("*.log"))
    )


def _disk_full_in(wd: Path, stage: str, path: Path | re.Pattern, output: str) -> dict[str, int]:
    """The DiskFull message about `path` (or a path the pattern matches) in a stage's logs or
    Snakemake's `output` (where a `script:` rule's traceback goes): bytes needed (at least: a
    stream's write says how many bytes it had written) and free."""
    log = _logs(wd, stage) + output
    named = path.pattern if isinstance(path, re.Pattern) else re.escape(str(path))
    m = re.search(
        named + r": No space left on device: writing it needs (?:more than the )?(\d+) bytes "
        r"\([^)]*\)(?: it had written)?, (\d+) bytes \([^)]*\) are free on (\S+)\.",
        log,
    )
    assert m, f"no DiskFull message naming {path} in:\n{log[-4000:]}"
    return {"needed": int(m.group(1)), "free": int(m.group(2))}
