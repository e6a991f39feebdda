"""distlm serve against the servers users would pick instead: throughput and p50/p99 latency at
1, 4 and 16 clients.

    python benchmarks/inference/bench_serve.py --model results/train/final --stages 1,2 \
        --out benchmarks/inference/serve-results.json

One run, the same model folder (--model, else a seeded model as bench.py builds it: GPT-2
architecture, or with `--arch llama` the Llama-family shape of LLAMA below) and prompts; the servers are measured one after the other (never two up at once), in an
order that rotates over --repeats:
  * distlm-sS: `distlm.entry.serve --launcher "mpiexec -n S"`, the rule's way: the API
    server (uvicorn) and the S-stage MPI pipeline with --lanes lanes, for each S of --stages;
    distlm-sS-aA with A API server processes (serve.api_servers), for each A of --api-servers
    other than 1;
  * distlm-eager-sS (asked for as distlm-eager): the same with inference.cuda_graphs false, a
    GPU's decode steps eager (the CPU's are either way): what the graphs buy, in one run;
  * distlm-overlap-sS (asked for as distlm-overlap): the same with inference.steps_in_flight 2,
    two micro-batches on the device at once, the host's work on one overlapping the device's on
    the other (the default is 1): what the overlap buys, in one run;
  * peer: `transformers serve MODEL --continuous-batching --device D` (paged attention and
    continuous batching; it ships with transformers), on the model folder as distlm writes it;
  * baseline: the way the Raspberry-Pi project distlm grew from served: a FastAPI app (in this file)
    doing one full-model Hugging Face `generate` per request, no pipeline;
  * llamacpp-T: llama.cpp's `llama-server` (--llama-server) on the folder converted to GGUF of type
    T (each of --gguf: f32, f16; peers.py converts with --llama-cpp's convert_hf_to_gguf.py), with
    continuous batching over --lanes slots of the model's context each, --threads threads.
    (llama-cpp-python's `llama_cpp.server` is not in the rotation: it runs one sequence at a time,
    and at temperature 0 it still applies its default repeat_penalty of 1.1, so its texts are not
    greedy ones.)
All get the same thread budget (OMP_NUM_THREADS = --threads: the pipeline's ranks share it, the
others' torch uses all of it). Each client sends non-streamed greedy completions of --max-tokens
tokens back to back for --seconds per level (at least --requests each), each on its one kept
HTTP connection as the OpenAI SDK's pool keeps it (--connections per-request: a new one a request); per level: completion
tokens / wall time, and the p50 / p99 of the requests' end-to-end latency, and where the time went
(`where_time_went`: each process's CPU by role, the benchmark client's own, and distlm's
micro-batches with their wall, host and device milliseconds each, the device's from CUDA events).
Reported: each, and ratios of every distlm over each other server. Greedy texts must equal `generate`'s (the
baseline's, or without it `generate` run here); the other servers' are compared and counted
(their batched kernels may break near-ties).
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

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py: the commit measured
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/harness/peer.py: `transformers serve`
sys.path.insert(0, str(Path(__file__).parent))
from provenance import git_revision

# --arch llama: SmolLM2-135M's architecture (LlamaForCausalLM; 576 wide, 30 layers, 9 heads, 3 KV
# heads, MLP 1536, tied embeddings, rope_theta 1e5) scaled to the seeded GPT-2's 6 x 384 (--layers,
# --embd, --heads) so both serve models of about the same cost on 2 CPU cores: 6 heads of 64 as
# SmolLM2, --kv-heads 2 (grouped-query attention 3:1, as SmolLM2's 9:3), the MLP at SmolLM2's 8/3
# of the width (1024), tied embeddings; the vocabulary is the benchmark tokenizer's 4096.
LLAMA = {"architecture": "llama", "rope_theta": 100000.0, "tie_embeddings": True}
SERVE = "distlm.entry.serve"  # the serve entry point, as rule serve starts it
PROMPTS = ROOT / "config" / "prompts.txt"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--model", help="model folder (default: the seeded model of bench.py)")
    p.add_argument("--stages", default="2", help="pipeline stage counts to measure, e.g. 1,2")
    from distlm.settings import EngineSettings

    p.add_argument("--lanes", type=int, default=EngineSettings().lanes, help="inference.lanes")
    p.add_argument("--threads", type=int, default=2, help="thread budget of each server")
    p.add_argument(
        "--api-servers", default="1", help="distlm's serve.api_servers to measure, e.g. 1,2,4"
    )
    p.add_argument("--clients", default="1,4,16")
    p.add_argument(
        "--requests", type=int, default=2, help="requests per client (at least 8 per level)"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0, help="at least this long per level")
    p.add_argument("--servers", default="baseline,peer,distlm", help="which servers to run")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where distlm (runtime.device) and the peer (transformers serve --device) run",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--connections",
        choices=["keep-alive", "per-request"],
        default="keep-alive",
        help="each client keeps its HTTP connection (the OpenAI SDK's pool), or opens one a request",
    )
    p.add_argument("--gguf", default="f32,f16", help="GGUF types the llama.cpp servers serve")
    p.add_argument(
        "--llama-cpp",
        help="llama.cpp source tree (its convert_hf_to_gguf.py) for the llamacpp servers; the "
        "llama-cpp-python source distribution carries one under vendor/llama.cpp",
    )
    p.add_argument("--llama-server", default="llama-server", help="llama.cpp's server binary")
    p.add_argument(
        "--arch",
        choices=["gpt2", "llama"],
        default="gpt2",
        help="the seeded model's architecture, without --model (llama: SmolLM2's, scaled)",
    )
    p.add_argument("--kv-heads", type=int, default=2, help="--arch llama: key/value heads")
    p.add_argument(
        "--intermediate",
        type=int,
        help="--arch llama: MLP width (default: 8/3 of --embd, up to a multiple of 64)",
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--out", default=str(Path(__file__).parent / "serve-results.json"))
    p.add_argument("--note", default="", help="what else ran on the machine (goes in the JSON)")
    p.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


# ----------------------------------------------------------------------------- the baseline server


class Completion(BaseModel):
    """The baseline's request (module level: FastAPI resolves the annotation by name)."""

    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    model: str | None = None


def baseline_app(model_dir: Path):
    """FastAPI, one full-model `generate` per request: the serving distlm replaces."""
    from fastapi import FastAPI

    from distlm.data import load_tokenizer

    model = hf_model(model_dir)
    tok = load_tokenizer(model_dir)
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    def complete(req: Completion):
        prompt_tokens, new = generate(model, tok, req.prompt, req.max_tokens)
        return {
            "choices": [{"text": tok.decode(new, skip_special_tokens=True), "index": 0}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(new)},
        }

    return app


def hf_model(model_dir: Path, device: str = "cpu"):
    """transformers' model of the folder (the baseline's, and `generate`'s greedy reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()  # pyright: ignore[reportArgumentType] (its decorated .to)


def generate(model, tok, prompt: str, max_tokens: int) -> tuple[int, list[int]]:
    """(prompt tokens, new token ids) of one greedy `generate` that stops at EOS."""
    import torch

    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device=model.device)
    with torch.inference_mode():
        # transformers' GenerationMixin self-type protocol does not match GPT2LMHeadModel
        out = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
            ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return ids.shape[1], out[0, ids.shape[1] :].tolist()


def generate_texts(
    model_dir: Path, prompts: list[str], max_tokens: int, device: str = "cpu"
) -> dict[str, str]:
    """`generate`'s greedy text of each prompt, as the baseline server answers it, on `device`."""
    from distlm.data import load_tokenizer

    model = hf_model(model_dir, device)
    tok = load_tokenizer(model_dir)
    return {
        p: tok.decode(generate(model, tok, p, max_tokens)[1], skip_special_tokens=True)
        for p in prompts
    }


def run_baseline(args) -> None:
    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    uvicorn.run(
        baseline_app(Path(args.model)),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


# ----------------------------------------------------------------------------- clients


class Connection:
    """A client's HTTP connection to a server: kept open from request to request, as the OpenAI
    SDK's connection pool (httpx) keeps it (`keep_alive`), or a new one for each request (a client
    without a pool, such as urllib). A kept connection the server closed between requests is
    opened again once."""

    def __init__(self, port: int, *, keep_alive: bool = True) -> None:
        self.port, self.keep_alive = port, keep_alive
        self.conn: http.client.HTTPConnection | None = None

    def request(self, body: str) -> tuple[int, bytes]:
        for attempt in (0, 1):
            conn = self.conn
            fresh = conn is None
            if conn is None:
                conn = self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if fresh or attempt:
                    raise
                continue
            if not self.keep_alive or r.will_close:
                self.close()
            return r.status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def post(port: int, body: dict, conn: Connection | None = None) -> tuple[float, int, str]:
    """(seconds, completion tokens, text) of one completion, on `conn` (else a connection of its
    own); with `stream` in the body, its server-sent events read to `[DONE]` (the tokens from the
    usage chunk it asks for)."""
    stream = bool(body.get("stream"))
    if stream:
        body = {**body, "stream_options": {"include_usage": True}}
    own = conn is None
    conn = conn or Connection(port, keep_alive=False)
    t0 = time.perf_counter()
    status, data = conn.request(json.dumps(body))
    seconds = time.perf_counter() - t0
    if own:
        conn.close()
    if status != 200:
        raise RuntimeError(f"port {port}: HTTP {status}: {data[:300]!r}")
    if not stream:
        doc = json.loads(data)
        return seconds, doc["usage"]["completion_tokens"], doc["choices"][0]["text"]
    events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    if not usage or not data.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(
            f"port {port}: a stream without its usage chunk or [DONE]: {data[-300:]!r}"
        )
    text = "".join(c["text"] for e in events for c in e.get("choices") or ())
    return seconds, usage[-1]["completion_tokens"], text


def level(
    port: int,
    prompts: list[str],
    clients: int,
    per_client: int,
    max_tokens: int,
    seconds: float,
    *,
    stream: bool = False,
    keep_alive: bool = True,
) -> dict:
    """`clients` clients, each sending requests back to back: at least `per_client` each, and
    until `seconds` have passed; `stream`: streamed completions; `keep_alive`: each client keeps
    its connection from request to request (else a new one a request)."""
    from distlm.runtime.heap import freeze_startup_heap

    start = time.perf_counter()

    def client(c: int) -> list[tuple[float, int, str]]:
        out, i = [], 0
        conn = Connection(port, keep_alive=keep_alive)
        while i < per_client or time.perf_counter() - start < seconds:
            body = {
                "prompt": prompts[(c * per_client + i) % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0,
                **({"stream": True} if stream else {}),
            }
            out.append(post(port, body, conn))
            i += 1
        conn.close()
        return out

    # this process's own full garbage collections would land in every server's latencies
    # alike: what it holds now is frozen out of them, as the servers do (distlm.runtime.heap)
    freeze_startup_heap(f"benchmark client, {clients} clients")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "clients": clients,
        "connections": "keep-alive" if keep_alive else "one a request",
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
    }


def wait_up(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server on {port} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            )
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on {port} did not come up:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def processes(pid: int) -> dict[str, list]:
    """The server's processes by role: distlm's supervisor, API server processes (`--api`) and
    pipeline ranks (`--engine`), the launcher's own; another server's are all "server"."""
    import psutil

    top = psutil.Process(pid)
    out: dict[str, list] = {}
    for p in [top, *top.children(recursive=True)]:
        try:
            argv = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        python = bool(argv) and Path(argv[0]).name.startswith("python")
        if SERVE not in argv:
            role = "server"
        elif "--api" in argv:
            role = "api"
        elif "--engine" in argv:
            role = "engine" if python else "launcher"
        else:
            role = "supervisor" if p is top else "launcher"
        out.setdefault(role, []).append(p)
    return out


def cpu_seconds(procs: list) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def stage_figures(port: int) -> dict[str, dict[str, float]]:
    """distlm's per-stage counters from /metrics: micro-batches, host (compute) and device
    seconds of the forward passes, by stage."""
    names = {
        "distlm_stage_micro_batches": "micro_batches",
        "distlm_stage_compute_seconds": "compute_s",
        "distlm_stage_device_seconds": "device_s",
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names and rest.startswith('stage="'):
            stage = rest[7:].partition('"')[0]
            out.setdefault(stage, {})[names[name]] = float(line.rsplit(" ", 1)[1])
    return out


def where_time_went(name: str, pid: int, port: int, run) -> dict:
    """One level (`run()`'s row) with where its time went: each role's CPU in cores busy (CPU
    seconds / wall: 1.0 is a core all the time), the benchmark client's own, and for distlm each
    stage's micro-batches and their wall, host and device milliseconds each (wall: the level's
    wall time / micro-batches, so host + what is not the forward pass)."""
    import resource

    procs = processes(pid)
    cpu0 = {role: cpu_seconds(ps) for role, ps in procs.items()}
    me = resource.getrusage(resource.RUSAGE_SELF)
    figures0 = {}
    deadline = time.monotonic() + 10  # the stages' figures come with stage 0's Health (0.5 s)
    while name.startswith("distlm") and not figures0 and time.monotonic() < deadline:
        figures0 = stage_figures(port)
        time.sleep(0 if figures0 else 0.1)
    row = run()
    wall = row["wall_s"]
    mine = resource.getrusage(resource.RUSAGE_SELF)
    row["cpu_cores"] = {
        **{role: round((cpu_seconds(ps) - cpu0[role]) / wall, 3) for role, ps in procs.items()},
        "client": round((mine.ru_utime + mine.ru_stime - me.ru_utime - me.ru_stime) / wall, 3),
    }
    if figures0:
        stages = []
        for stage, now in sorted(stage_figures(port).items()):
            was = figures0.get(stage, {})
            steps = now.get("micro_batches", 0) - was.get("micro_batches", 0)
            each = {
                k: round(1e3 * (now.get(k, 0) - was.get(k, 0)) / max(steps, 1), 3)
                for k in ("compute_s", "device_s")
            }
            stages.append(
                {
                    "stage": int(stage),
                    "micro_batches": int(steps),
                    "wall_ms_each": round(1e3 * wall / max(steps, 1), 3),
                    "host_ms_each": each["compute_s"],
                    "device_ms_each": each["device_s"],
                }
            )
        row["stages"] = stages
    return row


def measure(
    name: str, cmd: list[str], port: int, work: Path, args, prompts, levels, env: dict
) -> tuple[list, dict]:
    log = work / f"{name}.log"
    with open(log, "a") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        wait_up(proc, port, log)
        texts = {
            p: post(port, {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0})[2]
            for p in prompts
        }  # also the warm-up
        rows = [
            where_time_went(
                name,
                proc.pid,
                port,
                lambda c=c: level(
                    port,
                    prompts,
                    c,
                    max(args.requests, -(-8 // c)),
                    args.max_tokens,
                    args.seconds,
                    keep_alive=args.connections == "keep-alive",
                ),
            )
            for c in levels
        ]
    finally:
        stop(proc)
    return rows, texts


def main() -> None:
    args = parse()
    if args.baseline_server:
        run_baseline(args)
        return
    import torch
    from bench import seeded_model
    from harness.peer import transformers_serve_command, transformers_serve_env
    from peers import llama_env, llama_server_command
    from transformers import __version__ as transformers_version

    from distlm.inference.prompts import read_prompts
    from distlm.runtime.dist import free_port

    levels = [int(c) for c in args.clients.split(",")]
    stage_counts = [int(x) for x in args.stages.split(",")]
    api_counts = [int(x) for x in args.api_servers.split(",")]
    prompts = read_prompts(PROMPTS)
    with tempfile.TemporaryDirectory(prefix="distlm-bench-serve-") as tmp:
        work = Path(tmp)
        arch = {}
        if args.arch == "llama":
            mlp = args.intermediate or -(-8 * args.embd // (3 * 64)) * 64
            arch = {**LLAMA, "n_kv_head": args.kv_heads, "intermediate_size": mlp}
        model = Path(args.model) if args.model else seeded_model(work / "seeded", args, **arch)
        model_config = json.loads((model / "config.json").read_text())
        names = []
        ggufs = {}
        for name in args.servers.split(","):
            if name == "llamacpp":
                for t in args.gguf.split(","):
                    ggufs[t] = gguf_file(model, t, work, args)
                names += [f"{name}-{t}" for t in args.gguf.split(",")]
                continue
            if name in ("distlm", "distlm-eager", "distlm-overlap"):  # the variants: see the doc
                names += [
                    f"{name}-s{n}" + (f"-a{a}" if a != 1 else "")
                    for n in stage_counts
                    for a in api_counts
                ]
            else:
                names.append(name)
        runs: dict[str, list[list[dict]]] = {n: [] for n in names}
        texts = {}
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                port = free_port()
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                if name.startswith("llamacpp-"):
                    cmd = llama_server_command(
                        args.llama_server,
                        ggufs[name.removeprefix("llamacpp-")],
                        port=port,
                        threads=args.threads,
                        slots=args.lanes,
                        context=model_context(model_config),
                    )
                    env = llama_env(args.threads)
                elif name == "baseline":
                    cmd = [
                        sys.executable,
                        __file__,
                        "--baseline-server",
                        "--model",
                        str(model),
                        "--port",
                        str(port),
                        "--threads",
                        str(args.threads),
                    ]
                elif name == "peer":
                    cmd = transformers_serve_command(model, port=port, device=args.device)
                    env = transformers_serve_env(args.threads)
                else:
                    server, variant = name.rsplit("-s", 1)
                    stages, _, api = variant.partition("-a")
                    cmd = distlm_command(
                        work,
                        model,
                        int(stages),
                        port,
                        args,
                        levels,
                        eager=server == "distlm-eager",
                        overlap=server == "distlm-overlap",
                        api_servers=int(api or 1),
                    )
                rows, texts[name] = measure(name, cmd, port, work, args, prompts, levels, env)
                runs[name].append(rows)
                print(
                    name,
                    json.dumps(
                        [
                            {
                                **{
                                    k: round(r[k], 3)
                                    for k in ("clients", "tokens_per_s", "p50_s", "p99_s")
                                },
                                "cpu_cores": r["cpu_cores"],
                                **({"stages": r["stages"]} if "stages" in r else {}),
                            }
                            for r in rows
                        ]
                    ),
                    flush=True,
                )
        ref = texts.get("baseline") or generate_texts(model, prompts, args.max_tokens, args.device)
        for name in names:
            if name.startswith("distlm") and texts[name] != ref:
                raise RuntimeError(f"{name} disagrees with generate on greedy text: {texts}")
        peer_agrees = sum(texts["peer"][p] == ref[p] for p in prompts) if "peer" in texts else None
        llama_agree = {
            name: f"{sum(texts[name][p] == ref[p] for p in prompts)}/{len(prompts)}"
            for name in names
            if name.startswith("llamacpp")
        }
    summary = {}
    for name, reps in runs.items():
        summary[name] = [
            {
                "clients": c,
                **{
                    k: statistics.median(rep[i][k] for rep in reps)
                    for k in ("tokens_per_s", "p50_s", "p99_s")
                },
            }
            for i, c in enumerate(levels)
        ]
    ratios = {}
    for name in names:
        for other in ("peer", "baseline", *(n for n in names if n.startswith("llamacpp"))):
            if not name.startswith("distlm") or other not in summary:
                continue
            ratios[f"{name}_over_{other}"] = [
                {
                    "clients": c,
                    "throughput": summary[name][i]["tokens_per_s"]
                    / summary[other][i]["tokens_per_s"],
                    "p50": summary[name][i]["p50_s"] / summary[other][i]["p50_s"],
                    "p99": summary[name][i]["p99_s"] / summary[other][i]["p99_s"],
                }
                for i, c in enumerate(levels)
            ]
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "servers": names,
        "stages": stage_counts,
        "lanes": args.lanes,
        "threads": args.threads,
        "clients": levels,
        "requests_per_client": args.requests,
        "seconds_per_level": args.seconds,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "model": str(args.model or f"seeded {args.arch} {args.layers}x{args.embd}"),
        "model_config": {
            k: model_config.get(k)
            for k in (
                "architectures",
                "hidden_size",
                "n_embd",
                "num_hidden_layers",
                "n_layer",
                "num_attention_heads",
                "n_head",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
            if k in model_config
        },
        "peer_greedy_texts_equal_generate": None
        if peer_agrees is None
        else f"{peer_agrees}/{len(prompts)}",
        "llamacpp_greedy_texts_equal_generate": llama_agree,
        "llamacpp": llama_versions(args) if llama_agree else None,
        "median_over_repeats": summary,
        "ratios": ratios,
        "runs": runs,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),  # the code measured (benchmarks/provenance.py)
        "note": args.note,
        # where distlm and the peer ran: the GPU's name (benchmarks/summary.py's device column)
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers_version,
            "load_avg": os.getloadavg(),
            "note": "shared with other jobs; figures are ratios of runs in the same run",
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median_over_repeats": summary, "ratios": ratios}, indent=2))


def model_context(model_config: dict) -> int:
    """The model's context length (GPT-2: n_positions; Llama: max_position_embeddings)."""
    return model_config.get("n_positions") or model_config["max_position_embeddings"]


def gguf_file(model: Path, outtype: str, work: Path, args) -> Path:
    """The model folder as a GGUF file of `outtype`, converted once per run (peers.py)."""
    from peers import gguf_model

    if not args.llama_cpp:
        raise SystemExit("--servers llamacpp needs --llama-cpp (llama.cpp's source tree)")
    return gguf_model(model, work / f"model-{outtype}.gguf", outtype, Path(args.llama_cpp))


def llama_versions(args) -> dict:
    """Which llama.cpp served: the server binary's --version and llama-cpp-python's."""
    from importlib.metadata import PackageNotFoundError, version

    r = subprocess.run(
        [args.llama_server, "--version"], capture_output=True, text=True, check=False
    )
    try:
        py = version("llama_cpp_python")
    except PackageNotFoundError:
        py = None
    return {
        "llama_server_version": (r.stdout + r.stderr).strip().splitlines(),
        "llama_cpp_python": py,
        "gguf": args.gguf.split(","),
        "slots": args.lanes,
    }


def distlm_command(
    work: Path,
    model: Path,
    stages: int,
    port: int,
    args,
    levels,
    *,
    eager: bool = False,
    overlap: bool = False,
    api_servers: int = 1,
    serve: dict | None = None,
) -> list[str]:
    """serve.py's command line for an S-stage pipeline folder of `model`, config as the rule
    writes it; `eager`: inference.cuda_graphs false (a GPU's decode steps not captured);
    `overlap`: inference.steps_in_flight 2; `api_servers`: serve.api_servers; `serve`: more
    serve keys."""
    from bench import sharded

    from distlm.dag.config import validate_config
    from distlm.dag.stages import stage_config
    from distlm.settings.stage_configs import write_stage_config

    cfg = validate_config(
        {
            "runtime": {"device": args.device},
            "inference": {
                "stages": stages,
                "lanes": args.lanes,
                "timeout_s": 300,
                **({"cuda_graphs": False} if eager else {}),
                **({"steps_in_flight": 2} if overlap else {}),
            },
            "serve": {
                "port": port,
                "max_tokens": args.max_tokens,
                "max_queued_sequences": 4 * max(levels),
                "api_servers": api_servers,
                **(serve or {}),
            },
        }
    )
    variant = ("-eager" if eager else "") + ("-overlap" if overlap else "")
    cfg_path = work / f"serve-s{stages}-a{api_servers}{variant}.json"
    write_stage_config("serve", stage_config(cfg, "serve"), cfg_path)
    return [
        sys.executable,
        "-m",
        SERVE,
        "--launcher",
        f"mpiexec -n {stages}",
        "--config",
        str(cfg_path),
        "--model",
        str(sharded(model, stages, work)),
    ]


if __name__ == "__main__":
    main()
