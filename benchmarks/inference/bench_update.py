"""Live weight updates under load: clients keep sending greedy completions (streamed and not)
while the server takes updates from disk, alternately two sets of weights, each from a model
folder and from a pipeline folder, and with --push every other update pushed by a 2-rank training
job; what users see of it.

    python benchmarks/inference/bench_update.py --model results/train/final \
        --other results/model/base --clients 64 --updates 5 --push \
        --out benchmarks/inference/update-results.json

The server is rule serve's (`distlm.entry.serve`, serve.stages --stages) on --model; the update
route (POST /update_weights_from_disk, policy --policy) alternates --other and --model, every
other update from a pipeline folder cut from it. With --push the server follows training
(serve.follow_training) and the 2nd, 4th, ... update is a training job of the train stage
(torchrun, 2 ranks, gloo: the main job's resolved train config with max_steps 2, 4, ... and one
checkpoint, at the end, on --tokens from --model) whose rank 0 pushes its last checkpoint
(distlm.train.pushes; its window is the server's own record of it, /health's last_update).
Reported: what each switch cost the requests (the server's `stall`: new requests held, every
token stopped; the GPU goal of #65 is a switch_s of GPT-2 small at most 0.3 s); failed requests
(any non-200, any stream without [DONE]); answers whose chunks name more than one set of weights, or weights other
than the two; greedy texts against `generate` on the weights each answer names (an aborted one: a
prefix); the end-to-end p99 of the requests that ran while no update did (steady) and of those
that overlapped an update (from the request to the route's answer), and their ratio (issue #65's
CPU goal: at most 2x); each update's seconds and bytes as the route answers them. The device the
figures come from is named (runtime.device).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from provenance import git_revision

ROUTE = "/update_weights_from_disk"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--model", required=True, help="the served model folder (weights A)")
    ap.add_argument(
        "--other",
        required=True,
        help="a model folder of other weights (B) of --model's architecture, or `perturbed`: "
        "--model's weights plus seeded noise, written beside the run",
    )
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--policy", default="wait", choices=("wait", "abort"))
    ap.add_argument("--steady-s", type=float, default=10.0, help="load before the first update")
    ap.add_argument("--between-s", type=float, default=4.0, help="load between two updates")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--push", action="store_true", help="every other update pushed by a 2-rank training job"
    )
    ap.add_argument("--tokens", default="results/data/tokens.h5", help="--push: token blocks")
    ap.add_argument(
        "--train-config", default="results/config/train.json", help="--push: the train config"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--merge-into",
        default=None,
        help="a results file (bench_serve.py's) to add these figures to, as its `update`",
    )
    return ap.parse_args()


def request(port: int, body: dict) -> dict:
    """One completion: its times, status, the fingerprints it names, text and finish reason."""
    t0 = time.perf_counter()
    out = {"t0": t0, "prompt": body["prompt"], "status": 0, "fps": [], "text": "", "reason": None}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        data = r.read()
        conn.close()
        out["status"] = r.status
        if r.status == 200 and body.get("stream"):
            events = [
                json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")
            ]
            if not data.rstrip().endswith(b"data: [DONE]"):
                out["status"] = -1
            out["fps"] = sorted({e["system_fingerprint"] for e in events})
            out["text"] = "".join(c["text"] for e in events for c in e["choices"])
            reasons = [
                c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
            ]
            out["reason"] = reasons[-1] if reasons else None
        elif r.status == 200:
            doc = json.loads(data)
            out["fps"] = [doc["system_fingerprint"]]
            out["text"] = doc["choices"][0]["text"]
            out["reason"] = doc["choices"][0]["finish_reason"]
    except (OSError, ValueError, KeyError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["t1"] = time.perf_counter()
    return out


def perturbed(model: Path, out: Path) -> Path:
    """--model's weights plus seeded noise (0.1 of each tensor's spread), as a model folder."""
    import torch

    from distlm.model import load_safetensors, read_meta, write_model_dir

    sd = load_safetensors(model / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    noisy = {
        k: (v.float() + 0.1 * v.float().std().nan_to_num() * torch.randn(v.shape, generator=g)).to(
            v.dtype
        )
        for k, v in sd.items()
    }
    meta = read_meta(model).model_dump()
    keep = ("created_by", "source", "config_digest", "data_config_digest", "dtype")
    tok = tokenizer_dir(model, out.parent)
    write_model_dir(
        out, state_dict=noisy, config_from=model, tokenizer_dir=tok, meta={k: meta[k] for k in keep}
    )
    return out


def tokenizer_dir(model: Path, work: Path) -> Path:
    """work/tokenizer: the model folder's tokenizer files (everything but weights and
    documents)."""
    tok = work / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "distlm.json", "config.json"):
            (tok / f.name).write_bytes(f.read_bytes())
    return tok


def train_and_push(j: int, args, model: Path, work: Path) -> tuple[Path, str]:
    """Push j (0, 1, ...): a 2-rank training job of 2 (j + 1) steps from --model whose rank 0
    pushes its one checkpoint into the following server; returns the run's output folder and its
    rank 0 log."""
    from distlm.core.documents import read_document, write_document
    from distlm.launch.torchrun import local_torchrun, stage_args, train_args
    from distlm.settings.train import TrainConfig

    cfg = read_document(ROOT / args.train_config, TrainConfig)
    steps = 2 * (j + 1)
    train = cfg.train.model_copy(
        update={
            "nproc_per_node": 2,
            "max_steps": steps,
            "ckpt_every": steps,
            "eval_every": steps,
            "eval_batches": 1,
            "profile": cfg.train.profile.model_copy(update={"enabled": False}),
        }
    )
    cfg = cfg.model_copy(update={"train": train})
    path = work / f"train-{j}.json"
    write_document(path, cfg)
    out = work / "results" / "train"  # the endpoint is results/serve's beside it
    cmd = local_torchrun(
        stage_args(
            "train",
            nproc=2,
            args=train_args(
                config=path,
                tokens=(ROOT / args.tokens).resolve(),
                tokenizer=tokenizer_dir(model, work),
                model=model,
                out=out,
                rank_log=work / f"train-{j}" / "rank{rank}.log",
            ),
        )
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    log = (work / f"train-{j}" / "rank0.log").read_text()
    print(
        f"push {j + 1}: training job of {steps} steps, rc {proc.returncode}, "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the training job failed:\n{proc.stderr[-3000:]}\n{log[-3000:]}")
    return out, log


def checkpoint_folder(out: Path, digest: str, model: Path, dest: Path) -> Path:
    """The checkpoint of `out`'s runs whose weights are `digest`, as a model folder (to
    `generate` on)."""
    from distlm.model import load_safetensors, read_meta, write_model_dir

    for index in out.glob("checkpoints/*/step-*/checkpoint.json"):
        if json.loads(index.read_text())["sha256"]["model.safetensors"] == digest:
            meta = read_meta(model).model_dump()
            keep = ("created_by", "source", "config_digest", "data_config_digest", "dtype")
            write_model_dir(
                dest,
                state_dict=load_safetensors(index.parent / "model.safetensors"),
                config_from=model,
                tokenizer_dir=tokenizer_dir(model, dest.parent.parent),
                meta={k: meta[k] for k in keep},
            )
            return dest
    raise SystemExit(f"no checkpoint under {out} holds the pushed weights {digest}")


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def p99(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))] if xs else None


def main() -> None:
    args = parse()
    import bench_serve as bs
    from bench import sharded

    from distlm.inference.messages import fingerprint
    from distlm.inference.prompts import read_prompts
    from distlm.model import read_meta
    from distlm.runtime.dist import free_port

    work = Path(tempfile.mkdtemp(prefix="bench-update-"))
    model = Path(args.model).resolve()
    other = perturbed(model, work / "other") if args.other == "perturbed" else Path(args.other)
    other = other.resolve()
    prompts = read_prompts(ROOT / "config" / "prompts.txt")[:8]
    weights = {"A": read_meta(model).model_sha256, "B": read_meta(other).model_sha256}
    fp = {fingerprint(w): k for k, w in weights.items()}
    ref = {
        k: bs.generate_texts(folder, prompts, args.max_tokens, args.device)
        for k, folder in (("A", model), ("B", other))
    }
    sources = [
        other,
        model,
        sharded(other, 2, work / "B"),
        sharded(model, 2, work / "A"),
    ]
    port = free_port()
    ns = argparse.Namespace(device=args.device, lanes=args.lanes, max_tokens=args.max_tokens)
    follow = {"follow_training": True} if args.push else {}
    cmd = bs.distlm_command(work, model, args.stages, port, ns, [args.clients], serve=follow)
    if args.push:  # where the training job's rank 0 finds the server (its results/serve/)
        cmd += ["--endpoint", str(work / "results" / "serve" / "endpoint.json")]
    clock = time.time() - time.perf_counter()  # wall clock - perf_counter
    log = work / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
        )
    results: list[dict] = []
    updates: list[dict] = []
    pushed: list[tuple[str, Path, str]] = []  # (key, the training run's folder, its weights)
    stop = threading.Event()

    def client(c: int) -> None:
        i = 0
        while not stop.is_set():
            body = {
                "prompt": prompts[(c + i) % len(prompts)],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                **({"stream": True} if (c + i) % 2 else {}),
            }
            results.append(request(port, body))
            i += 1

    try:
        bs.wait_up(proc, port, log)
        threads = [
            threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)
        ]
        t_load = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.steady_s)
        disk = 0
        for k in range(args.updates):
            if args.push and k % 2:
                j = k // 2
                out, rank0 = train_and_push(j, args, model, work)
                last = health(port).get("last_update") or {}
                ok = f"step {2 * (j + 1)}: pushed to" in rank0 and "step" in last.get("source", "")
                key = f"push{j + 1}"
                weights[key] = last.get("weights", "")
                fp[fingerprint(weights[key])] = key
                pushed.append((key, out, weights[key]))
                at = last.get("at", time.time())
                updates.append(
                    {
                        "source": f"training job {j + 1} (2 ranks), {last.get('source')}",
                        "status": 200 if ok else 400,
                        "t0": at - last.get("seconds", 0) - clock,
                        "t1": at - clock,
                        "wall_s": last.get("seconds"),
                        "success": ok,
                        "seconds": last.get("seconds"),
                        "bytes": last.get("bytes"),
                        "stall": last.get("stall"),
                        "weights": weights[key],
                    }
                )
                print(f"update {k + 1}: pushed {ok} in {last.get('seconds', 0):.3f} s", flush=True)
                time.sleep(args.between_s)
                continue
            src = sources[disk % len(sources)]
            disk += 1
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
            t0 = time.perf_counter()
            conn.request(
                "POST",
                ROUTE,
                json.dumps({"model_path": str(src), "policy": args.policy}),
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            answer = json.loads(r.read())
            t1 = time.perf_counter()
            updates.append(
                {
                    "source": str(src),
                    "status": r.status,
                    "t0": t0,
                    "t1": t1,
                    "wall_s": t1 - t0,
                    **answer,
                }
            )
            print(
                f"update {k + 1}: {r.status} {answer.get('message')} in {t1 - t0:.3f} s, "
                f"stall {answer.get('stall')}",
                flush=True,
            )
            time.sleep(args.between_s)
        stop.set()
        for t in threads:
            t.join(timeout=600)
    finally:
        stop.set()
        bs.stop(proc)
    for key, out, digest in pushed:  # `generate` on each pushed set of weights
        folder = checkpoint_folder(out, digest, model, work / "pushed" / key)
        ref[key] = bs.generate_texts(folder, prompts, args.max_tokens, args.device)
    warm = [r for r in results if r["t0"] > t_load + 2.0]  # past the first requests' warm-up
    failed = [r for r in results if r["status"] != 200 or "error" in r]
    mixed = [
        r for r in results if r["status"] == 200 and (len(r["fps"]) != 1 or r["fps"][0] not in fp)
    ]
    wrong = [
        r
        for r in results
        if r["status"] == 200
        and len(r["fps"]) == 1
        and r["fps"][0] in fp
        and not _matches(r, ref[fp[r["fps"][0]]][r["prompt"]])
    ]
    windows = [(u["t0"], u["t1"]) for u in updates]
    during = [
        r["t1"] - r["t0"] for r in warm if any(r["t0"] < b and r["t1"] > a for a, b in windows)
    ]
    steady = [
        r["t1"] - r["t0"] for r in warm if not any(r["t0"] < b and r["t1"] > a for a, b in windows)
    ]
    import torch
    import transformers

    doc = {
        "what": "live weight updates under load (bench_update.py)",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": git_revision(),  # the code measured (benchmarks/provenance.py)
        # the GPU's name, or cpu (benchmarks/summary.py's device column)
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_avg": os.getloadavg(),
        },
        "args": vars(args),
        "requests": len(results),
        "failed": len(failed),
        "failures": [r.get("error") or r["status"] for r in failed[:5]],
        "mixed_or_unknown_weights": len(mixed),
        "greedy_differs": len(wrong),
        "aborted": sum(r["reason"] == "abort" for r in results),
        "p99_steady_s": p99(steady),
        "p99_during_update_s": p99(during),
        "requests_during_update": len(during),
        "p99_ratio": (p99(during) or 0) / (p99(steady) or 1),
        "pushes": len(pushed),
        # what the switches cost the requests (the server's own figures, messages.Stall): the
        # longest time new requests were held, and every token stopped
        "held_s_max": max((u["stall"]["held_s"] for u in updates if u.get("stall")), default=None),
        "switch_s_max": max(
            (u["stall"]["switch_s"] for u in updates if u.get("stall")), default=None
        ),
        "updates": [{k: v for k, v in u.items() if k not in ("t0", "t1")} for u in updates],
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "updates"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.merge_into and Path(args.merge_into).is_file():
        into = json.loads(Path(args.merge_into).read_text())
        into["update"] = doc
        Path(args.merge_into).write_text(json.dumps(into, indent=1) + "\n")


def _matches(r: dict, text: str) -> bool:
    """A greedy answer is its weights' `generate` text (an aborted one, a prefix of it)."""
    return text.startswith(r["text"]) if r["reason"] == "abort" else text == r["text"]


if __name__ == "__main__":
    main()
