"""The data stage through the user's command (`snakemake --profile profiles/local
results/data/stats.json`): one job per shard, each cached; a file added to the corpus tokenizes
only its shard and the index; a prep killed halfway (its whole process group) reruns only the
shards it had not finished; a shard job's memory is bounded by its batch, not by its corpus; the
FineWeb-edu config's dry run plans a job a shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT, TINY, run_snakemake, snakemake_cmd
from test_kill_workflow import job_counts

from distlm.data import load_embedded, train_tokenizer
from distlm.data.documents import read_stats

pytestmark = pytest.mark.slow

STATS = "results/data/stats.json"


def english() -> list[str]:
    return [t for _, t in load_embedded()]


def corpus_config(tmp: Path, work: Path, **data) -> Path:
    """A config over tiny.yaml: the data stage on `work`/corpus/*.jsonl, with a tokenizer of its
    own (data.tokenizer.name: no file of the corpus decides it), and `data`'s keys."""
    tok = tmp / "tokenizer"
    if not tok.is_dir():
        train_tokenizer(english()[:40], 1024, 2, tok)
    conf = tmp / f"{work.name}.yaml"
    base = {
        "source": "local",
        "local": {"train": [str(work / "corpus" / "*.jsonl")]},
        "validation_fraction": 0.2,
        "test_fraction": 0.2,
        "tokenizer": {"name": str(tok), "vocab_size": 1024},
    }
    conf.write_text(yaml.safe_dump({"data": {**base, **data}}))
    return conf


def write_corpus(folder: Path, n: int, docs_each: int = 8, start: int = 0) -> list[Path]:
    """`n` .jsonl files of `docs_each` documents of 2,000 characters of real text each (pieces of
    the embedded corpus), so the files are about one size."""
    folder.mkdir(parents=True, exist_ok=True)
    text = " ".join(english())
    pieces = [text[i : i + 2000] for i in range(0, len(text) - 2000, 2000)]
    paths = []
    for i in range(start, start + n):
        part = [pieces[(i * docs_each + j) % len(pieces)] for j in range(docs_each)]
        p = folder / f"part-{i:03d}.jsonl"
        p.write_text("".join(json.dumps({"text": f"{i}: {d}"}) + "\n" for d in part))
        paths.append(p)
    return paths


def one_file_a_shard(files: list[Path]) -> float:
    """A data.shard_mb that holds any one of `files` whole and no two together."""
    sizes = [p.stat().st_size for p in files]
    assert 2 * min(sizes) > 1.1 * max(sizes)
    return 1.05 * max(sizes) / 2**20


def shard_files(work: Path) -> dict[str, tuple[int, int]]:
    """shard file -> (inode, mtime_ns): what rewriting it would change."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in (work / "results/data/shards").glob("*.h5")
    }


def incomplete(work: Path) -> set[str]:
    """The outputs Snakemake marked as being written by a job that had not ended."""
    import base64

    folder = work / ".snakemake" / "incomplete"
    return (
        {
            base64.urlsafe_b64decode(p.name.encode()).decode(errors="replace")
            for p in folder.iterdir()
            if p.is_file()
        }
        if folder.is_dir()
        else set()
    )


def test_an_added_file_tokenizes_its_shard_and_the_index_only(tmp_path):
    work = tmp_path / "work"
    files = write_corpus(work / "corpus", 10)
    conf = corpus_config(tmp_path, work, shard_mb=one_file_a_shard(files))
    cfgs = (TINY, conf)
    first = run_snakemake(work, STATS, configfiles=cfgs)
    assert job_counts(first) == {"data_tokenizer": 1, "tokenize_shard": 10, "prepare_data": 1}
    before = shard_files(work)
    assert len(before) == 10

    assert job_counts(run_snakemake(work, STATS, "-n", configfiles=cfgs)) == {}
    write_corpus(work / "corpus", 1, start=10)  # the glob finds it: no config edit
    plan = run_snakemake(work, STATS, "-n", configfiles=cfgs)
    assert job_counts(plan) == {"tokenize_shard": 1, "prepare_data": 1}
    run_snakemake(work, STATS, configfiles=cfgs)
    after = shard_files(work)
    assert len(after) == 11 and {k: after[k] for k in before} == before  # none rewritten
    stats = read_stats(work / STATS)
    assert len(stats.shards) == 11 and all(sh.tokens_per_s > 0 for sh in stats.shards)

    # an edit of a key the shards do not read (the blocks' size) gathers again, nothing more
    edit = tmp_path / "block.yaml"
    edit.write_text(yaml.safe_dump({"data": {"block_size": 32}}))
    assert job_counts(run_snakemake(work, STATS, "-n", configfiles=(*cfgs, edit))) == {
        "prepare_data": 1
    }


def test_a_prep_killed_halfway_reruns_only_its_unfinished_shards(tmp_path):
    work = tmp_path / "work"
    files = write_corpus(work / "corpus", 8, docs_each=500)  # about a second of tokenizing each
    shard_mb = one_file_a_shard(files)
    conf = corpus_config(tmp_path, work, shard_mb=shard_mb)
    cfgs = (TINY, conf)
    cmd = snakemake_cmd(work, STATS, "--cores", "1", configfiles=cfgs)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(shard_files(work)) < 3 and proc.poll() is None:
            assert time.monotonic() < deadline, "no shard finished in 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the user's kill: Snakemake, its jobs, all of it
    finally:
        proc.wait(timeout=60)
    # finished: the shards whose jobs Snakemake saw end (a file renamed into place by a job the
    # kill stopped before Snakemake heard of its end is complete, but its job is not: it reruns)
    running = incomplete(work)
    finished = {
        k: v for k, v in shard_files(work).items() if f"results/data/shards/{k}" not in running
    }
    assert 2 <= len(finished) < 8, f"{len(finished)} shards finished before the kill"
    assert not list((work / "results/data").rglob(".*.tmp"))  # nothing partial left
    run_snakemake(work, "--unlock", configfiles=cfgs)
    rerun = run_snakemake(work, STATS, configfiles=cfgs)
    after = shard_files(work)
    assert len(after) == 8 and {k: after[k] for k in finished} == finished
    assert job_counts(rerun).get("tokenize_shard") == 8 - len(finished)

    clean = tmp_path / "clean"
    write_corpus(clean / "corpus", 8, docs_each=500)
    run_snakemake(
        clean, STATS, configfiles=(TINY, corpus_config(tmp_path, clean, shard_mb=shard_mb))
    )
    got, want = read_stats(work / STATS), read_stats(clean / STATS)
    assert {s: v.tokens_sha256 for s, v in got.splits.items()} == {
        s: v.tokens_sha256 for s, v in want.splits.items()
    }


def test_a_shard_jobs_memory_is_bounded_by_its_batch_not_its_corpus(tmp_path):
    """One shard of 4 MB and one of 16 MB, each a job of its own: the larger's peak memory is
    within 1.2x the smaller's (a job that held its corpus, or its ids, would grow by tens of
    MB: the release before used about 37 bytes a token)."""
    peaks = {}
    for mb in (4, 16):
        work = tmp_path / f"w{mb}"
        folder = work / "corpus"
        folder.mkdir(parents=True)
        docs, size, lines = english(), 0, []
        while size < mb << 20:
            d = json.dumps({"text": docs[len(lines) % len(docs)]}) + "\n"
            lines.append(d)
            size += len(d.encode())
        (folder / "big.jsonl").write_text("".join(lines))
        conf = corpus_config(tmp_path, work, shard_mb=64)
        run_snakemake(work, STATS, configfiles=(TINY, conf))
        (shard,) = read_stats(work / STATS).shards
        peaks[mb] = shard.peak_rss_mb
        assert sum(shard.tokens.values()) > mb * 150_000  # it did tokenize the corpus
    assert peaks[16] <= 1.2 * peaks[4], peaks


def test_the_fineweb_config_plans_a_tokenize_job_a_shard(tmp_path):
    """config/gpt2-124m-fineweb-edu.yaml on a local folder laid out like the hub data set
    (parquet shards of a train split only): the dry run plans one tokenize job per shard of the
    plan, each of at most data.shard_mb of text."""
    from test_data import write_fineweb_standin

    from distlm.dag.config import deep_merge, validate_settings
    from distlm.data.sharding import plan_data

    root = tmp_path / "fineweb-edu"
    write_fineweb_standin(root, english() * 4, files=4, row_group=8)
    over = {"data": {"hub": {"path": str(root)}, "shard_mb": 0.05}}
    edit = tmp_path / "standin.yaml"
    edit.write_text(yaml.safe_dump(over))
    fineweb = ROOT / "config" / "gpt2-124m-fineweb-edu.yaml"
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = run_snakemake(tmp_path / "work", "-n", configfiles=(fineweb, edit), env=env)
    settings = validate_settings(deep_merge(yaml.safe_load(fineweb.read_text()), over))
    os.environ.update(env)
    plan = plan_data(settings.data, settings.model)
    groups = sum(
        pq.ParquetFile(p).metadata.num_row_groups for p in (root / "sample/10BT").iterdir()
    )
    assert 4 <= len(plan.shards) <= groups
    assert job_counts(proc)["tokenize_shard"] == len(plan.shards)
    assert all(
        sh.source.text_bytes <= 0.05 * 2**20 or len(sh.source.units) == 1 for sh in plan.shards
    )
