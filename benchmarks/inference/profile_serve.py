"""Where a serving step's host time goes at N clients: the API server's and stage 0's CPU time
per token and per decode step, and what it is spent on, sampled with py-spy.

    python benchmarks/inference/profile_serve.py --model results/train/final --clients 64
    python benchmarks/inference/profile_serve.py --clients 64 --src ../before/src   # another checkout

(An older checkout whose config has fewer keys runs its own copy of this script, cd'ed into it.)

It starts `distlm serve` as bench_serve.py does (the rule's command: the API server and a
one-stage MPI pipeline with --lanes lanes, OMP_NUM_THREADS 1 a process), sends N clients'
non-streamed greedy completions back to back (each client on its one kept connection, as the
OpenAI SDK's pool; --connections per-request: a new one a request), and once they run steady it samples both
processes for --seconds with `py-spy record --format raw` (idle frames left out; the API server's
samples only while it holds the GIL, see `sample`) while it reads
their CPU time and the tokens /metrics counts. Each sample's stack is put in the first bucket
its frames match (BUCKETS: the model's forward pass, sampling, the scheduler, the engine
channel's messages, ZeroMQ; the server's HTTP, JSON, its request handling, detokenization,
metrics, asyncio), so the JSON gives each process's CPU seconds per token and per decode step
(tokens / lanes busy), each bucket's share, and the functions most samples were in (`top`:
the innermost frame, "function (file:line)", of each sample).

On a GPU a 91M model's decode step at 64 lanes is a CUDA graph of a few milliseconds, so the
host's share is what bounds serving (docs/performance.md, "Serving"); on the CPU the forward
pass is the CPU's own work, so the figure to read is the host time outside it, which is the
same Python and the same messages on either device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (bucket, a substring of a frame "function (file)" that puts a sample there), first match wins,
# looked for from the innermost frame out
BUCKETS = {
    "engine": [
        ("forward pass", "pipeline_stage.py"),
        ("forward pass", "family/"),
        ("sampling", "sampling_params.py"),
        ("sampling", "sampling.py"),  # its name before 2026-11-28's (an older checkout: --src)
        ("sampling", "engine/sampler.py"),
        ("messages", "messages.py"),
        ("messages", "msgpack"),
        ("zmq", "zmq/"),
        ("scheduler", "scheduler.py"),
        ("engine loop", "engine/serve.py"),
        ("ring (MPI)", "engine/ring.py"),
    ],
    "server": [
        ("detokenize", "tokenization"),
        ("detokenize", "tokenizers"),
        ("messages", "messages.py"),
        ("messages", "msgpack"),
        ("metrics", "prometheus_client"),
        ("answer", "server/render.py"),
        ("answer", "server/shapes.py"),
        ("request", "server/requests.py"),
        ("request", "server/prepare.py"),
        ("request", "pydantic"),
        ("engine channel", "server/client.py"),
        ("zmq", "zmq/"),
        ("JSON", "json/"),
        ("HTTP", "uvicorn"),
        ("HTTP", "h11"),  # the HTTP parser before 2026-11-29's httptools (an older --src)
        ("HTTP", "httptools"),
        ("HTTP", "server/transport.py"),
        ("HTTP", "starlette"),
        ("HTTP", "fastapi"),
        ("routes", "server/app.py"),
        ("routes", "server/answer.py"),
        ("asyncio", "asyncio/"),
    ],
}


def child_pid(server_pid: int, flag: str) -> int | None:
    """The pid of the Python process under the server whose command line has `flag`: stage 0
    (`--engine`, the MPI job's rank) or an API server process (`--api`); None when none comes."""
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.Process(server_pid).children(recursive=True):
            try:
                argv = p.cmdline()
                if flag in argv and Path(argv[0]).name.startswith("python"):
                    return p.pid  # not the launcher's (mpiexec's) own, which names it too
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.5)
    return None


def cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def thread_cpu_s(pid: int) -> dict[str, float]:
    """Each thread's CPU seconds, by its name (/proc's comm: Python's main thread takes the
    process's name, ZeroMQ's I/O threads are ZMQbg/IO/N), threads of one name summed: py-spy
    sees only the Python threads, and counts a thread preempted inside a system call (a write
    that wakes the reader) as busy, so this is the CPU's own account of who spent it."""
    import psutil

    out: dict[str, float] = collections.defaultdict(float)
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            continue
        out[name] += t.user_time + t.system_time
    return dict(out)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def sample(pid: int, seconds: float, rate: int, out: Path, *, gil: bool) -> subprocess.Popen:
    """py-spy on `pid`; `gil`: only the thread holding the GIL is sampled (the API server, all of
    whose work is Python's: a thread preempted inside a system call, such as a socket write that
    wakes its reader, is not counted as busy, as it is otherwise; the engine's forward pass runs
    without the GIL, so it is sampled without this)."""
    cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds))]
    cmd += ["--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"]
    cmd += ["--gil"] if gil else []
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def buckets(raw: Path, rules: list[tuple[str, str]]) -> dict[str, int]:
    """Samples per bucket of py-spy's raw output (collapsed stacks: "frame;frame;... count")."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")[::-1]  # innermost first
        name = next(
            (b for f in frames for b, pat in rules if pat in f),
            "other",
        )
        counts[name] += int(n)
    return dict(counts.most_common())


def fit_config(path: Path, src: Path) -> None:
    """The serve config as another checkout (--src) reads it: the `serve` keys it does not know
    left out when they hold their defaults (what that checkout does); else an error."""
    known = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import json; from distlm.settings.inference import ServeSettings; "
                    "print(json.dumps(list(ServeSettings.model_fields)))"
                ),
            ],
            env={**os.environ, "PYTHONPATH": str(src.resolve())},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    from distlm.settings.inference import ServeSettings

    doc = json.loads(path.read_text())
    serve = doc["serve"]
    for key in [k for k in serve if k not in known]:
        default = ServeSettings.model_fields[key].default
        if serve[key] != default:
            raise SystemExit(f"--src {src} has no serve.{key}; asked for {serve[key]!r}")
        del serve[key]
    path.write_text(json.dumps(doc, indent=2) + "\n")


def top(raw: Path, n: int = 15) -> dict[str, float]:
    """The share of the samples whose innermost frame is each function, the n largest."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        counts[stack.rsplit(";", 1)[-1]] += int(k)
    total = sum(counts.values()) or 1
    return {f: round(c / total, 3) for f, c in counts.most_common(n)}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--model", type=Path, help="model folder (default: bench.py's seeded model)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--lanes", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20, help="the sampled window")
    p.add_argument("--warmup", type=float, default=8, help="load before the window")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    p.add_argument("--src", type=Path, default=ROOT / "src", help="the distlm to run")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("profile-serve.json"))
    p.add_argument("--note", default="")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="runtime.device")
    p.add_argument("--stream", action="store_true", help="streamed completions")
    p.add_argument(
        "--connections",
        choices=["keep-alive", "per-request"],
        default="keep-alive",
        help="each client keeps its HTTP connection (the OpenAI SDK's pool), or opens one a request",
    )
    p.add_argument("--stream-interval", type=int, default=1, help="serve.stream_interval")
    p.add_argument(
        "--merge-into",
        type=Path,
        help="also put the result under `profile` in this JSON (benchmarks/gpu/run.sh: the serve "
        "step's results, one file back from the device)",
    )
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench import prompts, seeded_model
    from bench_serve import distlm_command, level, stop, wait_up
    from provenance import git_revision

    work = Path(tempfile.mkdtemp(prefix="distlm-profile-serve-"))
    args = argparse.Namespace(device=a.device, lanes=a.lanes, max_tokens=a.max_tokens)
    model = a.model or seeded_model(
        work, argparse.Namespace(arch="gpt2", layers=6, embd=384, heads=6)
    )
    port = 18000 + os.getpid() % 1000
    cmd = distlm_command(
        work, model, 1, port, args, [a.clients], serve={"stream_interval": a.stream_interval}
    )
    if a.src.resolve() != (ROOT / "src").resolve():
        fit_config(Path(cmd[cmd.index("--config") + 1]), a.src)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(a.src.resolve())}
    log = work / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_up(proc, port, log)
        engine = child_pid(proc.pid, "--engine")
        if engine is None:
            raise SystemExit("no stage 0 (`--engine`) process under the server")
        # the API server process under the supervisor (serve.api_servers 1); a checkout before
        # 2026-11-28's api_servers (--src) has none: its API server is the process itself
        api = child_pid(proc.pid, "--api")
        texts = prompts(str(ROOT / "config" / "prompts.txt"), a.clients)
        load = threading.Thread(
            target=level,
            args=(port, texts, a.clients, 1, a.max_tokens, a.warmup + a.seconds + 4),
            kwargs={"stream": a.stream, "keep_alive": a.connections == "keep-alive"},
            daemon=True,
        )
        load.start()
        time.sleep(a.warmup)
        pids = {"server": api or proc.pid, "engine": engine}
        supervisor_cpu0 = cpu_s(proc.pid) if api else None
        cpu0 = {k: cpu_s(pid) for k, pid in pids.items()}
        threads0 = {k: thread_cpu_s(pid) for k, pid in pids.items()}
        tok0, t0 = metric(port, "distlm_generation_tokens_total"), time.perf_counter()
        spies = {
            k: sample(pid, a.seconds, a.rate, work / f"{k}.txt", gil=k == "server")
            for k, pid in pids.items()
        }
        lanes = []
        while time.perf_counter() - t0 < a.seconds:
            lanes.append(metric(port, "distlm_lanes_busy"))
            time.sleep(1)
        tokens = metric(port, "distlm_generation_tokens_total") - tok0
        wall = time.perf_counter() - t0
        cpu = {k: cpu_s(pid) - cpu0[k] for k, pid in pids.items()}
        threads = {
            k: {n: c - threads0[k].get(n, 0.0) for n, c in thread_cpu_s(pid).items()}
            for k, pid in pids.items()
        }
        supervisor_cpu = None if supervisor_cpu0 is None else cpu_s(proc.pid) - supervisor_cpu0
        for k, s in spies.items():
            if s.wait(timeout=a.seconds + 60) != 0:
                raise SystemExit(f"py-spy on the {k} (pid {pids[k]}) failed")
        load.join()
    finally:
        stop(proc)
    busy = sum(lanes) / max(1, len(lanes))
    steps = tokens / max(busy, 1.0)
    result: dict = {
        "what": f"host time of distlm serve at {a.clients} clients, {a.lanes} lanes, one stage"
        + (f", streamed (serve.stream_interval {a.stream_interval})" if a.stream else ""),
        "connections": a.connections,
        "device": a.device,
        "command": " ".join(["python", "benchmarks/inference/profile_serve.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "src": str(a.src),
        "cpus": os.cpu_count(),
        "machine": {"cpus": os.cpu_count()},
        # the code measured: this checkout's, or --src's checkout when it names another
        "revision": git_revision(a.src.resolve().parent),
        "window_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "lanes_busy_mean": round(busy, 1),
        "decode_steps_per_s": round(steps / wall, 1),
        "processes": {},
        "supervisor_cpu_s": None if supervisor_cpu is None else round(supervisor_cpu, 2),
        "note": a.note,
    }
    for k in pids:
        share = buckets(work / f"{k}.txt", BUCKETS[k])
        total = sum(share.values()) or 1
        result["processes"][k] = {
            "cpu_s": round(cpu[k], 2),
            "cpu_us_per_token": round(1e6 * cpu[k] / max(tokens, 1), 1),
            "cpu_ms_per_decode_step": round(1e3 * cpu[k] / max(steps, 1), 2),
            "threads_us_per_token": {
                n: round(1e6 * c / max(tokens, 1), 1)
                for n, c in sorted(threads[k].items(), key=lambda x: -x[1])
                if c > 0.005
            },
            "share": {b: round(n / total, 3) for b, n in share.items()},
            "top": top(work / f"{k}.txt"),
        }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    if a.merge_into is not None:
        doc = json.loads(a.merge_into.read_text())
        doc["profile"] = result
        a.merge_into.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
