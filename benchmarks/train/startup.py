"""A training rank's start-up: CPU seconds from its launch to its first step, on the tiny config,
for this checkout and, side by side in the same run, another one (the release before).

    python benchmarks/train/startup.py                              # this checkout alone
    git worktree add /tmp/before 794d75f
    python benchmarks/train/startup.py --other /tmp/before --repeats 3 \\
        --out benchmarks/train/results-startup.json

It runs the train stage's command as the workflow's rule does (`torchrun --standalone
--nproc-per-node 2 -m distlm.entry.train --config ... --out ...`, OMP_NUM_THREADS the rule's
threads) on the tiny config's data and base model (tests/configs/tiny.yaml, built once with this
checkout's workflow under --workdir), each checkout's `src` first on PYTHONPATH, the checkouts
taking turns `--repeats` times. Every rank records its process's CPU seconds (user + system, all
threads) when its first training step starts and when it exits, and the modules it loaded
(tests/harness/process_hooks: `Trainer.train_step` patched once the process imports it; the
same hook for both checkouts). The JSON holds each run's ranks and the medians, and this
checkout's median over the other's.
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from harness.processes import entry_point, process_env, process_records

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
HEAVY = ("transformers", "torch._dynamo", "torch.distributed.tensor", "scipy")


def build_inputs(work: Path) -> Path:
    """The tiny config's token file, base model and resolved train config (this checkout's
    workflow), once per work folder."""
    wd = work / "workflow"
    if not (wd / "results" / "config" / "train.json").is_file():
        wd.mkdir(parents=True, exist_ok=True)
        targets = ["results/data/tokens.h5", "results/model/base", "results/config/train.json"]
        cmd = [sys.executable, "-m", "snakemake", *targets, "-s", str(ROOT / "Snakefile")]
        cmd += ["--directory", str(wd), "--configfile", str(TINY)]
        cmd += ["--profile", str(ROOT / "profiles" / "local")]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return wd


def run(src: Path, wd: Path, out: Path, nproc: int) -> dict:
    """One start of the train stage with `src` first on PYTHONPATH; its ranks' records."""
    from distlm.launch.torchrun import stage_args, train_args  # the command, this checkout's

    records = out / "records"
    shutil.rmtree(out, ignore_errors=True)
    env = process_env(records)
    env["PYTHONPATH"] = os.pathsep.join([str(src), env["PYTHONPATH"]])
    env["OMP_NUM_THREADS"] = str(nproc)  # Snakemake's: the rule's threads
    r = wd / "results"
    args = train_args(
        config=r / "config" / "train.json",
        tokens=r / "data/tokens.h5",
        tokenizer=r / "data/tokenizer",
        model=r / "model/base",
        out=out / "train",
    )
    cmd = ["torchrun", "--standalone", *stage_args("train", nproc=nproc, args=args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=wd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    ranks = [rec for rec in process_records(records) if entry_point(rec) == "train"]
    return {
        "wall_s": round(wall, 2),
        "ranks": [
            {
                "first_step_cpu_s": round(rec["first_step_cpu_s"], 3),
                "exit_cpu_s": round(rec["exit_cpu_s"], 3),
                "modules": len(rec["modules"]),
                "loaded": [m for m in HEAVY if m in rec["modules"]],
            }
            for rec in ranks
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--other", type=Path, help="another checkout (its src/ is what runs)")
    p.add_argument("--repeats", type=int, default=3, help="starts of each checkout, in turns")
    p.add_argument("--nproc", type=int, default=2, help="ranks (the tiny config's: 2)")
    p.add_argument("--workdir", type=Path, help="kept between calls (default: a temporary one)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/train/results-startup.json")
    p.add_argument("--note", default="", help="what else ran on the machine")
    a = p.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="distlm-startup-"))
    wd = build_inputs(work)
    sources = {"this": ROOT / "src", **({"other": a.other.resolve() / "src"} if a.other else {})}
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for i in range(a.repeats):
        for name, src in sources.items():
            runs[name].append(run(src, wd, work / f"{name}-{i}", a.nproc))
            print(name, i, runs[name][-1]["ranks"], flush=True)
    medians = {
        name: statistics.median(r["first_step_cpu_s"] for x in rs for r in x["ranks"])
        for name, rs in runs.items()
    }
    result = {
        "what": "CPU seconds of a training rank from its launch to its first step (tiny config)",
        "command": " ".join(["python", "benchmarks/train/startup.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "checkouts": {name: str(src.parent) for name, src in sources.items()},
        "nproc": a.nproc,
        "median_first_step_cpu_s": medians,
        "this_over_other": medians["this"] / medians["other"] if "other" in medians else None,
        "runs": runs,
        "note": a.note,
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_first_step_cpu_s", "this_over_other")}))
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
