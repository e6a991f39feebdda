"""The whole workflow at the real setup's shape on this machine: per job, wall time and peak memory.

    python benchmarks/e2e/run.py                          # config/gpt2-small-cpu.yaml: ~10 minutes
    python benchmarks/e2e/run.py --table benchmarks/e2e/results-gpt2-small-cpu.json   # table only

It runs the user's command, `snakemake --profile profiles/local --configfile CONFIG`, from the
repository root with `--directory` a fresh scratch folder (results/, logs/ and .snakemake/ land
there; the checkout is not touched), and samples the processes Snakemake starts every
`--interval` seconds with psutil. Every job Snakemake runs here is one child process of Snakemake
(the shell of a `shell:` rule, the interpreter of a `script:` rule), and every process the job
starts (torchrun and its ranks, mpiexec, its proxy and its ranks) is a descendant of that child,
so a job's figures are those of one process tree:

- wall time: from the child's start (its create time) to the first sample that no longer sees it.
  The kernel's create time is read against the boot time in whole seconds, so it can be up to a
  second early: in the committed run these walls are 0.4-0.6 s longer than Snakemake's `s`
  (which starts its clock just after the fork and stops it when the job's process is reaped);
- peak memory: the largest sum, over one sample, of the resident set size (RSS) of every process of
  the tree (shared pages, such as the torch libraries every rank maps, count once per process).

Snakemake's own `benchmark:` record of each rule (`results/benchmarks/<job>.tsv`: `s`,
`max_rss`, `max_pss`) is put beside them; it samples twice a second for the first 15 s of a job,
then every 30 s, so it can miss a short peak. The JSON also holds the machine, the date, the exact
command, the load average before and after, and the `--note` on what else ran; the markdown table
printed at the end (and by `--table`) is generated from the JSON alone.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from distlm.core.io import write_json

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py: the commit measured
from provenance import git_revision

FORMAT = "distlm-e2e-benchmark/1"
MB = 1024 * 1024

# A job's child process names its rule: `-m distlm.entry.<module>` (shell rules) or the script
# Snakemake writes as .snakemake/scripts/tmpXXXX.<script>.py (script rules).
ENTRY = re.compile(r"-m distlm\.entry\.(\w+)")
SCRIPT = re.compile(r"\.snakemake/scripts/tmp[^/\s]*?\.(\w+)\.py")
ENTRY_RULES = {
    "broadcast": "broadcast",
    "train": "train",
    "evaluate": "evaluate",
    "infer": "inference",
}


@dataclass
class Tree:
    """One child of Snakemake (one job) and what the sampler saw of its process tree."""

    pid: int
    started: float  # the child's create time (epoch seconds)
    cmdline: str
    ended: float | None = None  # first sample that no longer saw it
    peak_rss: int = 0
    peak_rss_at: float = 0.0
    max_processes: int = 0
    samples: int = 0
    descendants: dict[int, str] = field(default_factory=dict)  # pid -> command line


class Sampler(threading.Thread):
    """Samples the process trees of Snakemake's children until `stop` is set."""

    def __init__(self, snakemake_pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.main = psutil.Process(snakemake_pid)
        self.interval = interval
        self.trees: dict[int, Tree] = {}
        self.peak_total_rss = 0  # Snakemake and every job at one moment
        self.peak_snakemake_rss = 0
        self.samples = 0
        self.max_sample_s = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.time()
            try:
                self.sample(t0)
            except psutil.NoSuchProcess:
                break  # Snakemake itself has gone
            self.max_sample_s = max(self.max_sample_s, time.time() - t0)
            self.stop.wait(max(0.0, self.interval - (time.time() - t0)))

    def sample(self, now: float) -> None:
        own = self.main.memory_info().rss
        self.peak_snakemake_rss = max(self.peak_snakemake_rss, own)
        seen, total = set(), own
        for child in self.main.children(recursive=False):
            try:
                tree = self.trees.get(child.pid)
                if tree is None:
                    tree = Tree(child.pid, child.create_time(), shlex.join(child.cmdline()))
                    self.trees[child.pid] = tree
                procs = [child, *child.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if p.pid != child.pid and p.pid not in tree.descendants:
                        tree.descendants[p.pid] = shlex.join(p.cmdline())
                except psutil.NoSuchProcess:
                    continue
            seen.add(child.pid)
            tree.samples += 1
            tree.max_processes = max(tree.max_processes, len(procs))
            if rss > tree.peak_rss:
                tree.peak_rss, tree.peak_rss_at = rss, now
            total += rss
        for tree in self.trees.values():
            if tree.ended is None and tree.pid not in seen:
                tree.ended = now
        self.peak_total_rss = max(self.peak_total_rss, total)
        self.samples += 1


def rule_of(tree: Tree) -> tuple[str, str | None]:
    """(rule, Snakemake benchmark job name or None) of a child's process tree."""
    text = " ".join([tree.cmdline, *tree.descendants.values()])
    m = ENTRY.search(text)
    if m and m.group(1) in ENTRY_RULES:
        rule = ENTRY_RULES[m.group(1)]
        if rule == "evaluate":
            name = re.search(r"--name (\w+)", text)
            model = name.group(1) if name else "?"
            return f"evaluate[{model}]", f"evaluate_{model}"
        return rule, rule
    m = SCRIPT.search(text)
    if m:
        rule = m.group(1)
        if rule == "shard":
            return "shard[trained]", "shard_trained"  # rule all's only shard job
        return rule, None if rule == "resolve_config" else rule
    return f"other: {tree.cmdline[:80]}", None


def overlaps(jobs: list[dict], slack: float = 1.0) -> None:
    """Each job's `overlaps`: the jobs that ran beside it (a shared core slows both) for more than
    `slack` seconds, the error of a start time (see the module's docstring)."""
    for j in jobs:
        a0, a1 = j["start_s"], j["start_s"] + j["wall_s"]
        j["overlaps"] = sorted(
            {
                k["job"]
                for k in jobs
                if k is not j
                and min(a1, k["start_s"] + k["wall_s"]) - max(a0, k["start_s"]) > slack
            }
        )


def snakemake_benchmark(workdir: Path, job: str | None) -> dict | None:
    """Snakemake's `benchmark:` record of `job` (its TSV's one row), or None."""
    if job is None:
        return None
    path = workdir / "results" / "benchmarks" / f"{job}.tsv"
    if not path.is_file():
        return None
    with path.open() as f:
        row = next(csv.DictReader(f, delimiter="\t"))

    def num(key: str) -> float | None:
        v = row.get(key)
        return None if v in (None, "", "NA", "-") else float(v)

    return {k: num(k) for k in ("s", "max_rss", "max_pss", "max_uss", "cpu_time")}


def stage_facts(workdir: Path) -> dict:
    """A few figures the stages wrote, to read the timings by: data sizes, training throughput."""
    facts: dict = {}
    stats = workdir / "results" / "data" / "stats.json"
    if stats.is_file():
        facts["data_stats"] = json.loads(stats.read_text())
    metrics = workdir / "results" / "train" / "metrics.csv"
    if metrics.is_file():
        with metrics.open() as f:
            rows = list(csv.DictReader(f))
        if rows:
            times = [float(r["step_time_s"]) for r in rows]
            facts["train"] = {
                "steps": len(rows),
                "tokens": int(float(rows[-1]["tokens"])),
                "step_time_s": times,
                "final_loss": float(rows[-1]["loss"]),
            }
    return facts


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import snakemake
    import torch

    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gb": round(psutil.virtual_memory().total / 1024**3, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "snakemake": snakemake.__version__,
    }


def rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="distlm-e2e-")).resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"--workdir {workdir}: not empty (the run must start from nothing)")
    workdir.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("snakemake") or f"{sys.executable} -m snakemake"
    user_args = ["--profile", "profiles/local", "--configfile", rel(Path(args.configfile))]
    extra = ["--config", *args.config] if args.config else []
    argv = [*shlex.split(exe), *user_args, *extra, "--directory", str(workdir)]
    shown = shlex.join(["snakemake", *user_args, *extra, "--directory", "SCRATCH"])
    print(f"running: {shown}\n  SCRATCH = {workdir}", flush=True)
    load_before = os.getloadavg()
    log = (workdir.parent / f"{workdir.name}.snakemake.log").open("w")
    started = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(proc.pid, args.interval)
    sampler.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        rc = proc.wait()
    ended = time.time()
    sampler.stop.set()
    sampler.join()
    log.close()
    if rc != 0:
        tail = Path(log.name).read_text()[-4000:]
        raise SystemExit(f"snakemake exited {rc}; its output: {log.name}\n{tail}")

    jobs = []
    for tree in sorted(sampler.trees.values(), key=lambda t: t.started):
        rule, bench_job = rule_of(tree)
        end = tree.ended if tree.ended is not None else ended
        jobs.append(
            {
                "job": rule,
                "start_s": round(tree.started - started, 2),
                "wall_s": round(end - tree.started, 2),
                "peak_rss_mb": round(tree.peak_rss / MB, 1),
                "peak_at_s": round(tree.peak_rss_at - started, 2),
                "max_processes": tree.max_processes,
                "samples": tree.samples,
                "snakemake_benchmark": snakemake_benchmark(workdir, bench_job),
            }
        )
    overlaps(jobs)
    result = {
        "format": FORMAT,
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(
            timespec="seconds"
        ),
        "machine": machine(),
        "revision": git_revision(),
        "config": rel(Path(args.configfile)),
        "command": shown,
        "note": args.note,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "sampler": {
            "interval_s": args.interval,
            "samples": sampler.samples,
            "slowest_sample_s": round(sampler.max_sample_s, 3),
        },
        "total": {
            "wall_s": round(ended - started, 2),
            "peak_rss_mb": round(sampler.peak_total_rss / MB, 1),
            "snakemake_peak_rss_mb": round(sampler.peak_snakemake_rss / MB, 1),
        },
        "jobs": jobs,
        "stages": stage_facts(workdir),
    }
    if not args.keep:
        shutil.rmtree(workdir)
        Path(log.name).unlink()
    return result


def table(result: dict) -> str:
    """The markdown table of one result: a row per job in start order, then the whole run."""
    m = result["machine"]
    # the user's command; the scratch folder is no path a reader has
    command = result["command"].replace(" --directory SCRATCH", "")
    caption = (
        f"`{command}` (with `--directory` a scratch folder) on {m['cpu']} ({m['usable_cpus']} cores, {m['memory_gb']} GB), "
        f"{result['date'][:10]}; torch {m['torch']}, Snakemake {m['snakemake']}; "
        f"{result['note']}."
    )
    header = (
        "| job | start (s) | wall (s) | peak RSS, process tree (MB) | processes "
        "| Snakemake `benchmark:` s / max_rss / max_pss (MB) |"
    )
    lines = [caption, "", header, "| --- | ---: | ---: | ---: | ---: | --- |"]
    for j in result["jobs"]:
        b = j["snakemake_benchmark"]
        bench = (
            " / ".join(
                "NA" if b[k] is None else f"{b[k]:,.{1 if k == 's' else 0}f}"
                for k in ("s", "max_rss", "max_pss")
            )
            if b
            else "(no `benchmark:`)"
        )
        lines.append(
            f"| {j['job']} | {j['start_s']:.0f} | {j['wall_s']:.1f} | {j['peak_rss_mb']:,.0f} "
            f"| {j['max_processes']} | {bench} |"
        )
    t = result["total"]
    lines.append(
        f"| **whole run** | 0 | {t['wall_s']:.1f} | {t['peak_rss_mb']:,.0f} (with Snakemake's "
        f"{t['snakemake_peak_rss_mb']:,.0f}) | | |"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configfile", default=str(ROOT / "config" / "gpt2-small-cpu.yaml"))
    p.add_argument(
        "--config",
        nargs="+",
        default=[],
        help="passed to snakemake --config (e.g. a shorter trial: 'train={\"max_steps\": 2}')",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/e2e/results-gpt2-small-cpu.json"))
    p.add_argument("--workdir", help="scratch folder (empty or absent); default: a new temp folder")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder and its log")
    p.add_argument("--interval", type=float, default=0.2, help="sampling interval (s)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--note", default="quiet machine, one run under a shared lock")
    p.add_argument("--table", metavar="JSON", help="print the table of a result file and exit")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
