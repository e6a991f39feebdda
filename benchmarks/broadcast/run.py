"""Broadcast benchmark: the seed's method, the backend's flat broadcast and distlm's transfer, side by side.

    python benchmarks/broadcast/run.py                        # loopback + shaped fabric, 1-3 receivers
    python benchmarks/broadcast/run.py --fabrics loopback --receivers 1 --scale 0.25   # quick look

A GPT-2-124M-shaped fp32 state dict (148 tensors, 498 MB at --scale 1; loopback runs a scaled-down
copy, --loopback-scale, so the whole benchmark fits in minutes on 2 cores). For each fabric
(loopback: all ranks on 127.0.0.1; shaped: every rank in its own network namespace behind a
--rate-mbit link, see tests/harness/fabric.py) and each receiver count, one gloo world runs all methods
(benchmarks/broadcast/worker.py). Writes JSON (default benchmarks/broadcast/results.json): every run
with per-rank end times and peak RSS, then a summary with times, GB/s, ratios and the targets.
The shaped fabric needs root and iproute2; without them it is skipped with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from distlm.core.io import write_json
from distlm.runtime.dist import free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
# the simulated multi-host fabric is the test harness's (tests/harness/fabric.py)
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def _launch(cmds: list[list[str]], envs: list[dict], timeout: float) -> list[dict]:
    procs = [
        subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c, e in zip(cmds, envs)
    ]
    try:
        out, err = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"benchmark world timed out after {timeout} s: {' '.join(cmds[0])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = "\n".join(
            f"--- rank {r} ---\n{(p.stderr.read() if p.stderr else '')[-3000:]}"
            for r, p in enumerate(procs)
            if p.returncode
        )
        raise SystemExit(f"benchmark ranks failed {bad}:\n{err[-3000:]}\n{tails}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _env(rank: int, world: int, addr: str, port: int, extra: dict | None = None) -> dict:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


def run_world(fabric: str, receivers: int, args, fab=None) -> list[dict]:
    world = receivers + 1
    scale = args.loopback_scale if fabric == "loopback" else args.scale
    worker = [
        sys.executable,
        str(WORKER),
        "--bucket-mb",
        str(args.bucket_mb),
        "--chunk-mb",
        str(args.chunk_mb),
        "--scale",
        str(scale),
        "--methods",
        *args.methods,
    ]
    if fabric == "loopback":
        port = free_port()
        cmds = [worker] * world
        envs = [_env(r, world, "127.0.0.1", port) for r in range(world)]
    else:
        if fab is None:
            raise ValueError(f"fabric {fabric!r}: no fabric to start the ranks on")
        port = 29400
        cmds = [fab.command(r, worker) for r in range(world)]
        envs = [_env(r, world, fab.address(0), port, fab.env(r)) for r in range(world)]
    rows = _launch(cmds, envs, args.timeout_s)
    for row in rows:
        row["fabric"] = fabric
        row["gbps"] = row["bytes"] / row["seconds"] / 1e9
    return rows


def link_goodput(fab, mbytes: int = 64) -> float:
    """Raw TCP goodput host 1 -> host 0 in Gbit/s: what the shaped link carries."""
    port = 29500
    srv = (
        "import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        f"s.bind(('0.0.0.0',{port}));s.listen();c,_=s.accept();n=0;t=None\n"
        "while True:\n b=c.recv(1<<20)\n t=t or time.time()\n if not b: break\n n+=len(b)\n"
        "print(n*8/(time.time()-t)/1e9)"
    )
    cli = (
        f"import socket,time;time.sleep(0.5);s=socket.create_connection(('{fab.address(0)}',{port}));"
        f"b=bytes(1<<20)\nfor i in range({mbytes}): s.sendall(b)\ns.close()"
    )
    server = subprocess.Popen(
        fab.command(0, [sys.executable, "-c", srv]), stdout=subprocess.PIPE, text=True
    )
    subprocess.run(fab.command(1, [sys.executable, "-c", cli]), check=True, timeout=120)
    out, _ = server.communicate(timeout=120)
    return float(out.strip())


def summarize(rows: list[dict], args, link: dict) -> dict:
    by = {(r["fabric"], r["method"], r["receivers"]): r for r in rows}
    out: dict = {}
    for fabric in dict.fromkeys(r["fabric"] for r in rows):
        f: dict = {"seconds": {}, "gbps": {}, "peak_rss_mb": {}, "correct": True}
        for (fb, m, n), r in by.items():
            if fb != fabric:
                continue
            f["seconds"].setdefault(m, {})[n] = round(r["seconds"], 3)
            f["gbps"].setdefault(m, {})[n] = round(r["gbps"], 3)
            f["peak_rss_mb"].setdefault(m, {})[n] = [round(p["peak_mb"]) for p in r["per_rank"]]
            f["correct"] &= r["correct"]
        ns = sorted({n for (fb, _, n) in by if fb == fabric})
        lo, hi = ns[0], ns[-1]
        f["time_ratio_most_vs_fewest_receivers"] = {
            m: round(f["seconds"][m][hi] / f["seconds"][m][lo], 3)
            for m in f["seconds"]
            if hi in f["seconds"][m]
        }
        f["receivers_compared"] = [lo, hi]
        if "distlm" in f["seconds"]:
            f["speedup_distlm_vs"] = {
                m: {
                    n: round(f["seconds"][m][n] / f["seconds"]["distlm"][n], 3)
                    for n in f["seconds"][m]
                }
                for m in f["seconds"]
                if m != "distlm"
            }
        out[fabric] = f
    targets = {}
    sh, lb = out.get("shaped"), out.get("loopback")
    if sh and "distlm" in sh["seconds"]:
        r = sh["time_ratio_most_vs_fewest_receivers"]
        rate_gbps = args.rate_mbit / 1000
        good = {n: round(g * 8 / rate_gbps, 3) for n, g in sh["gbps"]["distlm"].items()}
        targets["shaped_distlm_time_ratio"] = {
            "value": r["distlm"],
            "target": "<= 1.3",
            "met": r["distlm"] <= 1.3,
        }
        for m in ("seed", "flat"):
            if m in r:
                targets[f"shaped_{m}_time_ratio"] = {
                    "value": r[m],
                    "target": "about 3 (for 1 vs 3 receivers)",
                }
        targets["shaped_distlm_goodput_fraction_of_link"] = {
            "value": good,
            "target": ">= 0.85",
            "met": min(good.values()) >= 0.85,
            "link_rate_gbit": rate_gbps,
            "measured_tcp_gbit": link.get("tcp_gbit"),
        }
    if lb and "flat" in lb["seconds"] and 1 in lb["seconds"]["flat"] and "distlm" in lb["seconds"]:
        v = round(lb["seconds"]["flat"][1] / lb["seconds"]["distlm"][1], 3)
        targets["loopback_1_receiver_distlm_speed_vs_flat"] = {
            "value": v,
            "target": ">= 0.9",
            "met": v >= 0.9,
        }
    out["targets"] = targets
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--fabrics", nargs="+", default=["loopback", "shaped"], choices=["loopback", "shaped"]
    )
    p.add_argument("--receivers", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument(
        "--methods",
        nargs="+",
        default=["distlm", "seed", "flat"],
        choices=["distlm", "seed", "flat"],
    )
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--chunk-mb", type=float, default=4)
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="model on the shaped fabric; 1.0: GPT-2 124M (498 MB)",
    )
    p.add_argument(
        "--loopback-scale",
        type=float,
        default=0.25,
        help="model on loopback (0.25: 125 MB, so a run on 2 busy cores stays short)",
    )
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # so the fabric's cleanup runs
    t0 = time.time()
    rows, link, skipped = [], {}, {}
    for fabric in args.fabrics:
        if fabric == "loopback":
            for n in args.receivers:
                rows += run_world("loopback", n, args)
                print(
                    f"loopback, {n} receivers: done ({time.time() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        from harness.fabric import Fabric, unavailable_reason

        reason = unavailable_reason()
        if reason:
            skipped["shaped"] = reason
            print(f"shaped fabric skipped: {reason}", file=sys.stderr)
            continue
        with Fabric(1 + max(args.receivers), rate_mbit=args.rate_mbit) as fab:
            link["tcp_gbit"] = round(link_goodput(fab), 3)
            for n in args.receivers:
                rows += run_world("shaped", n, args, fab)
                print(
                    f"shaped, {n} receivers: done ({time.time() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    result = {
        "benchmark": "distlm weight broadcast",
        "config": {
            **vars(args),
            "model": "GPT-2-124M-shaped fp32 state dict (148 tensors at scale 1)",
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "methods": {
            "seed": "per tensor, receiver after receiver (dist.send/recv)",
            "flat": "pack into one flat buffer + dist.broadcast + unpack (buffer preallocated, not timed)",
            "distlm": f"distlm.transfer: {args.bucket_mb} MB buckets, {args.chunk_mb} MB chunks, chain relay, checksums",
        },
        "link": link,
        "skipped": skipped,
        "wall_seconds": round(time.time() - t0, 1),
        "summary": summarize(rows, args, link) if rows else {},
        "runs": rows,
    }
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
