"""What benchmarks/gpu/run.sh writes under $OUT besides the benchmarks' own JSON.

    python benchmarks/gpu/collect.py workflow WORKDIR OUT/workflow-gpu.json
    python benchmarks/gpu/collect.py summary OUT/summary.json STEPS_JSON SECONDS

`workflow`: one file of what a run of config/gpu.yaml wrote: the broadcast report, both evaluation
reports, the training record (its steps, validations and one-time costs: the first step, which
holds torch.compile, and each validation's time), the inference timing and every rule's wall time
and memory (Snakemake's benchmark files). `summary`: the steps run.sh ran (command, exit code,
seconds), the machine, its GPU and the versions of what ran.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"missing": f"{path}: {e}"}


def _rows(path: Path, delimiter: str = ",") -> list[dict]:
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f, delimiter=delimiter))


def workflow(wd: Path) -> dict:
    res = wd / "results"
    steps = _rows(res / "train/metrics.csv")
    vals = _rows(res / "train/val.csv")
    return {
        "config": "config/gpu.yaml",
        "broadcast": _json(res / "broadcast/report.json"),
        "eval": {m: _json(res / f"eval/{m}.json") for m in ("base", "trained")},
        "train": {
            "record": _json(res / "train/final/distlm.json").get("training"),
            "one_time": {
                "first_step_s": float(steps[0]["step_time_s"]) if steps else None,
                "first_validation_s": float(vals[0]["seconds"]) if vals else None,
            },
            "steps": steps,
            "validations": vals,
            # issue #78: the steady steps' wait for rows from the token store, as a share of
            # the step (GPT-2 small's shape: config/gpu.yaml); the first step's one-time costs apart
            "data_wait_share": _wait_share(steps[1:]),
        },
        "inference": _json(res / "inference/timing.json"),
        "rules": {p.stem: _rows(p, "\t") for p in sorted((res / "benchmarks").glob("*.tsv"))},
    }


def _wait_share(steps: list[dict]) -> float | None:
    waits = [float(r["data_wait_s"]) for r in steps if r.get("data_wait_s")]
    total = sum(float(r["step_time_s"]) for r in steps if r.get("data_wait_s"))
    return sum(waits) / total if waits and total > 0 else None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def summary(steps: list[dict], seconds: int) -> dict:
    try:
        import torch

        gpu: dict = {
            "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    except Exception as e:  # the summary is written whatever failed
        gpu = {"error": str(e)}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        smi_out = subprocess.run(q, capture_output=True, text=True, check=False).stdout
        gpu["nvidia_smi"] = smi_out.strip().splitlines()
    names = ("distlm", "torch", "transformers", "snakemake", "mpich", "mpi4py", "uccl")
    return {
        "kind": "distlm-gpu-check",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"host": platform.node(), "python": platform.python_version(), "gpu": gpu},
        "versions": {n: _version(n) for n in names},
        "seconds": seconds,
        "steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    w = sub.add_parser("workflow", help="one JSON of what a run of config/gpu.yaml wrote")
    w.add_argument("workdir", type=Path, help="the run's working directory (results/ inside)")
    w.add_argument("out", type=Path)
    m = sub.add_parser("summary", help="run.sh's steps, the machine and the versions")
    m.add_argument("out", type=Path)
    m.add_argument("steps", help="the steps as a JSON list")
    m.add_argument("seconds", type=int, help="the whole run's wall time")
    a = p.parse_args()
    if a.what == "workflow":
        a.out.write_text(json.dumps(workflow(a.workdir), indent=1))
    else:
        doc = summary(json.loads(a.steps), a.seconds)
        a.out.write_text(json.dumps(doc, indent=2))
        print(json.dumps(doc["steps"], indent=1))


if __name__ == "__main__":
    main()
