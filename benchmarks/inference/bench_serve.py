"""What the serve front costs: the same requests to stage 0 directly and through the front, in one run.

    python benchmarks/inference/bench_serve.py --out benchmarks/inference/serve-results.json

Two servers of the same model (S stages each, launched with mpiexec) run side by side:
  * direct: `mpiexec -n S python workflow/scripts/serve.py --port P1` (stage 0 answers HTTP);
  * front:  `python workflow/scripts/serve.py --launcher "mpiexec -n S" --port P2`, the rule's way
    (the front relays every connection to stage 0 on 127.0.0.1).
Rounds alternate between them (A B, then B A) so load on a shared machine hits both alike. Per round
and server: a non-streamed completion of --max-tokens tokens (latency), a streamed one (time to the
first token's event, and to `[DONE]`), and --concurrent streamed requests at once (wall time).
Reported: medians per server and front / direct ratios (1.0 = no cost).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))
SERVE = ROOT / "workflow" / "scripts" / "serve.py"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the seeded model of bench.py)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--out", default=str(Path(__file__).parent / "serve-results.json"))
    return p.parse_args()


def post(port: int, body: dict) -> tuple[float, float, str]:
    """(seconds to the first body bytes after the head, seconds to the end, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    first = None
    chunks = []
    while True:
        data = r.read1(65536)
        if not data:
            break
        if first is None and b'"text": "' in data:
            first = time.perf_counter() - t0
        chunks.append(data)
    total = time.perf_counter() - t0
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"port {port}: HTTP {r.status}: {b''.join(chunks)[:300]!r}")
    return first if first is not None else total, total, b"".join(chunks).decode()


def wait_up(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on {port} did not come up:\n{log.read_text()[-3000:]}")


def main() -> None:
    args = parse()
    import torch

    from bench import seeded_model, sharded
    from distlm.config import validate_config
    from distlm.dist import free_port

    with tempfile.TemporaryDirectory(prefix="distlm-bench-serve-") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else seeded_model(work / "seeded", args)
        model = sharded(model, args.stages, work)
        ports = {"direct": free_port(), "front": free_port()}
        procs = {}
        for name, port in ports.items():
            cfg = validate_config({"inference": {
                "stages": args.stages, "lanes": max(4, args.concurrent),
                "serve": {"port": port, "max_tokens": args.max_tokens},
            }})
            cfg_path = work / f"{name}.json"
            cfg_path.write_text(json.dumps({"runtime": cfg["runtime"], "inference": cfg["inference"]}))
            script = [str(SERVE), "--config", str(cfg_path), "--model", str(model)]
            cmd = ([sys.executable, *script, "--launcher", f"mpiexec -n {args.stages}"] if name == "front"
                   else ["mpiexec", "-n", str(args.stages), sys.executable, *script])
            log = work / f"{name}.log"
            with open(log, "w") as out:
                procs[name] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                                env={**os.environ, "OMP_NUM_THREADS": "1"}), log)
        try:
            for name, (proc, log) in procs.items():
                wait_up(proc, ports[name], log)
            body = {"prompt": "The for statement", "max_tokens": args.max_tokens, "temperature": 0}
            rows = {name: {"latency_s": [], "stream_first_s": [], "stream_total_s": [], "concurrent_s": []}
                    for name in ports}
            texts = {}
            for name in ports:  # warm-up
                texts[name] = json.loads(post(ports[name], body)[2])["choices"][0]["text"]
            if texts["direct"] != texts["front"]:
                raise RuntimeError(f"the two servers disagree: {texts}")
            for rnd in range(args.rounds):
                order = list(ports) if rnd % 2 == 0 else list(reversed(ports))
                for name in order:
                    port, row = ports[name], rows[name]
                    row["latency_s"].append(post(port, body)[1])
                    first, total, _ = post(port, {**body, "stream": True})
                    row["stream_first_s"].append(first)
                    row["stream_total_s"].append(total)
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(args.concurrent) as pool:
                        list(pool.map(lambda _: post(port, {**body, "stream": True}), range(args.concurrent)))
                    row["concurrent_s"].append(time.perf_counter() - t0)
        finally:
            for proc, _ in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc, _ in procs.values():
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        medians = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in rows.items()}
        ratios = {k: medians["front"][k] / medians["direct"][k] for k in medians["direct"]}
        result = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "stages": args.stages, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "concurrent": args.concurrent, "model": str(args.model or f"seeded {args.layers}x{args.embd}"),
            "median": medians, "front_over_direct": ratios, "raw": rows,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "load_avg": os.getloadavg()},
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({"median": medians, "front_over_direct": ratios}, indent=2))


if __name__ == "__main__":
    main()
