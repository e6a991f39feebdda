"""The data stage side by side with nanoGPT's `prepare.py` way, on the same corpus, tokenizer and
cores, one after the other (issue #78's goals).

    python benchmarks/data/bench_prep.py --sizes 100,400 --out benchmarks/data/results.json

The corpus is real text: the Python standard library's sources, one document a file, repeated to
each size, as a .jsonl file. The tokenizer is a trained model folder's: the embedded default's
byte-level BPE (4,096 ids, trained as its data stage trains it), or `--tokenizer DIR`. Measured:

  prep      the whole data stage, `snakemake --profile profiles/local results/data/stats.json`
            (its listing, tokenizer and shard jobs and the gather; 2 cores, data.shard_mb 64),
            against `nanogpt_prepare.py` (datasets.map(num_proc=2), one np.memmap uint16 file a
            split), `--repeats` runs of each taking turns: wall seconds, tokens a second (the
            median run's ratio, and every run's), and the peak RSS of the largest process of
            each (GNU time: the largest of the command's processes, Snakemake's own included;
            the shard jobs' own peaks from stats.json beside it)
  scaling   the shard jobs alone (the tokenizer made): one job on one core (`taskset -c 0`,
            `--cores 1`) against two jobs on the two cores, on the corpus of the first size
  loader    the training loader (TokenBlocks.rows of StepSampler's steps, 16 blocks of 1024)
            against nanoGPT's `get_batch` (memmap of train.bin, random offsets, x and y) on the
            largest corpus's tokens, page cache warm
  fineweb   one shard of `--fineweb-mb` MB of text from a local folder laid out like
            FineWeb-edu's sample-10BT (parquet, row groups of 1,000 documents, a train split
            only), through config/gpt2-124m-fineweb-edu.yaml: its job's peak RSS and tokens a
            second (this tokenizer, not GPT-2's: the hub is not reachable here)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py: the commit measured
from provenance import git_revision


def stdlib_docs() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(lib.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
    return docs


def write_jsonl(path: Path, mb: float) -> int:
    """The corpus of `mb` MB: the stdlib's sources, one document a line, repeated; its bytes."""
    docs = stdlib_docs()
    target, size = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        i = 0
        while size < target:
            line = json.dumps({"text": docs[i % len(docs)]}) + "\n"
            f.write(line)
            size += len(line.encode())
            i += 1
    return size


def write_fineweb(root: Path, mb: float) -> int:
    """A local folder laid out like HuggingFaceFW/fineweb-edu's sample-10BT, `mb` MB of text,
    written a row group (1,000 documents) at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sub = root / "sample" / "10BT"
    sub.mkdir(parents=True, exist_ok=True)
    docs = stdlib_docs()
    size, i = 0, 0
    schema = pa.schema([("text", pa.string()), ("id", pa.string())])
    with pq.ParquetWriter(sub / "000_00000.parquet", schema) as w:
        while size < mb * 1e6:
            texts = [docs[(i + j) % len(docs)] for j in range(1000)]
            ids = [f"<urn:uuid:{i + j}>" for j in range(1000)]
            w.write_table(pa.table({"text": texts, "id": ids}, schema=schema))
            size += sum(len(t.encode()) for t in texts)
            i += 1000
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n"
        "    path: sample/10BT/*\n---\n"
    )
    return size


def run(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Wall seconds and the peak RSS (MB) of the largest of the command's processes, by GNU time
    (a process forked from this one would start from this one's high-water mark)."""
    measure = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-prep-time-{os.getpid()}.txt"
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%e %M", "-o", str(measure), *map(str, cmd)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{out[-4000:]}")
    wall, kb = measure.read_text().split()[-2:]
    measure.unlink()
    mb = round(int(kb) / 1024, 1)
    return {"seconds": round(float(wall), 2), "peak_rss_mb": mb, "out": proc.stdout}


def snakemake(work: Path, config: Path, *targets: str, cores: int = 2, pin: bool = False) -> dict:
    cmd = [sys.executable, "-m", "snakemake", *targets, "-s", str(ROOT / "Snakefile")]
    cmd += ["--directory", str(work), "--configfile", str(config)]
    cmd += ["--profile", str(ROOT / "profiles" / "local"), "--cores", str(cores)]
    if pin:
        cmd = ["taskset", "-c", "0", *cmd]
    return run(cmd)


def data_config(path: Path, data: dict) -> Path:
    """The default config's data stage on these keys (a model of 1,024 positions for its blocks)."""
    path.write_text(yaml.safe_dump({"data": data, "model": {"init": {"n_positions": 1024}}}))
    return path


def stats_of(work: Path) -> dict:
    return json.loads((work / "results" / "data" / "stats.json").read_text())


def prep_once(scratch: Path, tokenizer: Path, mb: float, corpus: Path, r: int) -> dict:
    """One repeat: the baseline first, then distlm, each in folders of their own (no cache of an
    earlier repeat: `datasets` caches its map, distlm its shards)."""
    suffix = f"{mb:g}" + (f"-{r}" if r else "")
    base = run(
        [sys.executable, str(HERE / "nanogpt_prepare.py"), str(corpus), str(tokenizer)]
        + [str(scratch / f"nanogpt-{suffix}"), "--num-proc", "2"]
    )
    base_tokens = sum(json.loads(base.pop("out").strip().splitlines()[-1])["tokens"].values())
    work = scratch / f"distlm-{suffix}"
    ours = snakemake(work, scratch / f"data-{mb:g}.yaml", "results/data/stats.json")
    ours.pop("out")
    stats = stats_of(work)
    tokens = sum(s["tokens"] for s in stats["splits"].values())
    shards = stats["shards"]
    return {
        "tokens": tokens,
        "nanogpt": {
            **base,
            "tokens": base_tokens,
            "tokens_per_s": round(base_tokens / base["seconds"]),
        },
        "distlm": {
            **ours,
            "tokens_per_s": round(tokens / ours["seconds"]),
            "shards": len(shards),
            "shard_peak_rss_mb": max(s["peak_rss_mb"] for s in shards),
            "shard_tokens_per_s": [s["tokens_per_s"] for s in shards],
        },
        "tokens_per_s_ratio": round(
            (tokens / ours["seconds"]) / (base_tokens / base["seconds"]), 3
        ),
    }


def prep(scratch: Path, tokenizer: Path, mb: float, repeats: int) -> dict:
    """`repeats` runs of each way, taking turns; the median ratio and each run's figures."""
    corpus = scratch / f"corpus-{mb:g}.jsonl"
    nbytes = write_jsonl(corpus, mb)
    data_config(
        scratch / f"data-{mb:g}.yaml",
        {
            "source": "local",
            "local": {"train": [str(corpus)]},
            "block_size": 1024,
            "tokenizer": {"name": str(tokenizer), "vocab_size": 4096},
        },
    )
    os.sync()
    runs = [prep_once(scratch, tokenizer, mb, corpus, r) for r in range(repeats)]
    ratios = [x["tokens_per_s_ratio"] for x in runs]
    mid = runs[ratios.index(statistics.median_low(ratios))]
    return {
        "corpus_mb": round(nbytes / 1e6, 1),
        **mid,  # the run of the median ratio (every run in `runs`)
        "tokens_per_s_ratios": ratios,
        "peak_rss_mb": {
            "distlm": max(x["distlm"]["peak_rss_mb"] for x in runs),
            "nanogpt": max(x["nanogpt"]["peak_rss_mb"] for x in runs),
        },
        "runs": runs,
    }


def scaling(scratch: Path, mb: float) -> dict:
    """The shard jobs of the first size again: one job on one core, then two on two."""
    work = scratch / f"distlm-{mb:g}"
    conf = scratch / f"data-{mb:g}.yaml"
    shards = sorted((work / "results" / "data" / "shards").glob("*.h5"))
    targets = [str(p.relative_to(work)) for p in shards]
    out: dict = {"shards": len(shards)}
    for name, cores, pin in (("one_job_one_core", 1, True), ("two_jobs_two_cores", 2, False)):
        for p in shards:
            p.unlink()
        r = snakemake(work, conf, *targets, cores=cores, pin=pin)
        r.pop("out")
        out[name] = r
    tokens = sum(s["tokens"] for s in stats_of(work)["splits"].values())
    for name in ("one_job_one_core", "two_jobs_two_cores"):
        out[name]["tokens_per_s"] = round(tokens / out[name]["seconds"])
    out["ratio"] = round(
        out["one_job_one_core"]["seconds"] / out["two_jobs_two_cores"]["seconds"], 3
    )
    return out


def loader(scratch: Path, mb: float, steps: int = 2000) -> dict:
    import torch

    from distlm.data import TokenBlocks
    from distlm.train.step_sampler import BatchPlan, StepSampler

    blocks = TokenBlocks(scratch / f"distlm-{mb:g}" / "results" / "data" / "tokens.h5", "train")
    batch, bs = 16, blocks.block_size
    sampler = StepSampler(len(blocks), BatchPlan(batch, 1, 1), 0, seed=0)
    train_bin = scratch / f"nanogpt-{mb:g}" / "train.bin"

    def get_batch():  # nanoGPT's train.py
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - bs, (batch,))
        x = torch.stack([torch.from_numpy((data[i : i + bs]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + bs]).astype(np.int64)) for i in ix])
        return x, y

    def ours(step):  # StepLoader's read of a step on the CPU
        return torch.from_numpy(blocks.rows(sampler.indices(step).reshape(-1)))

    out: dict = {"blocks_of": bs, "batch": batch, "store_tokens": blocks.n_tokens}
    for name, fn in (("nanogpt_get_batch", lambda s: get_batch()), ("distlm_rows", ours)):
        for s in range(50):
            fn(s)
        t0 = time.perf_counter()
        for s in range(steps):
            fn(1000 + s)
        dt = time.perf_counter() - t0
        out[name] = {
            "steps": steps,
            "seconds": round(dt, 3),
            "tokens_per_s": round(steps * batch * bs / dt),
        }
    out["ratio"] = round(
        out["distlm_rows"]["tokens_per_s"] / out["nanogpt_get_batch"]["tokens_per_s"], 3
    )
    return out


def fineweb(scratch: Path, tokenizer: Path, mb: float) -> dict:
    root = scratch / "fineweb-edu"
    nbytes = write_fineweb(root, mb)
    fw = yaml.safe_load((ROOT / "config" / "gpt2-124m-fineweb-edu.yaml").read_text())
    fw.update({"runtime": {"device": "cpu", "backend": "gloo"}})
    fw["data"]["hub"]["path"] = str(root)
    fw["data"]["tokenizer"] = {"name": str(tokenizer), "vocab_size": 4096}
    fw["data"]["shard_mb"] = mb * 1.1
    fw["data"]["validation_fraction"] = fw["data"]["test_fraction"] = 0.01  # blocks at any size
    conf = scratch / "fineweb.yaml"
    conf.write_text(yaml.safe_dump(fw))
    work = scratch / "fineweb-work"
    r = snakemake(work, conf, "results/data/stats.json", cores=1)
    r.pop("out")
    (shard,) = stats_of(work)["shards"]
    return {
        "text_mb": round(nbytes / 1e6, 1),
        "stage": r,
        "shard": {k: shard[k] for k in ("tokens", "seconds", "tokens_per_s", "peak_rss_mb")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", default="100,400", help="corpus sizes in MB")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: the embedded BPE)")
    p.add_argument("--fineweb-mb", type=float, default=450)
    p.add_argument("--repeats", type=int, default=3, help="runs of each way per size, taking turns")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out (fineweb, ...)")
    p.add_argument("--scratch", type=Path, default=Path("/tmp/distlm-bench-data"))
    p.add_argument("--out", type=Path, default=HERE / "results.json")
    a = p.parse_args()
    sizes = [float(x) for x in a.sizes.split(",")]
    skip = set(filter(None, a.skip.split(",")))
    shutil.rmtree(a.scratch, ignore_errors=True)
    a.scratch.mkdir(parents=True)
    tokenizer = a.tokenizer
    if tokenizer is None:
        from distlm.data import load_embedded, train_tokenizer
        from distlm.data.sources import rank_split

        docs = load_embedded()
        split = rank_split(docs, 0.05, 0.05, "embedded")
        tokenizer = a.scratch / "tokenizer"
        train_tokenizer([t for n, t in docs if split[n] == "train"], 4096, 2, tokenizer)
    result: dict = {
        "benchmark": "dataset prep: distlm's data stage vs nanoGPT's prepare.py way",
        "command": "python benchmarks/data/bench_prep.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_before": os.getloadavg(),
        },
        "device": "cpu",
        "tokenizer": str(tokenizer) if a.tokenizer else "the embedded default's BPE (4,096 ids)",
        "prep": {},
    }
    for mb in sizes:
        print(f"prep {mb:g} MB", flush=True)
        result["prep"][f"{mb:g}"] = prep(a.scratch, tokenizer, mb, a.repeats)
        print(json.dumps(result["prep"][f"{mb:g}"]["tokens_per_s_ratios"]), flush=True)
    small, large = (result["prep"][f"{mb:g}"] for mb in (sizes[0], sizes[-1]))
    result["peak_rss_growth"] = round(
        large["peak_rss_mb"]["distlm"] / small["peak_rss_mb"]["distlm"], 3
    )
    if "scaling" not in skip:
        print("scaling", flush=True)
        result["scaling"] = scaling(a.scratch, sizes[0])
    if "loader" not in skip:
        print("loader", flush=True)
        result["loader"] = loader(a.scratch, sizes[-1])
    if "fineweb" not in skip:
        print("fineweb", flush=True)
        result["fineweb"] = fineweb(a.scratch, tokenizer, a.fineweb_mb)
    result["host"]["load_avg_after"] = os.getloadavg()
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
