"""Tokens/s of Hugging Face `generate` vs the distlm MPI pipeline, side by side, in one run.

    python benchmarks/inference/bench.py                       # seeded GPT-2-architecture model
    python benchmarks/inference/bench.py --model results/train/final --prompts config/prompts.txt
    python benchmarks/inference/bench.py --out benchmarks/inference/results.json
    python benchmarks/inference/bench.py --device cuda --model results/train/final --stages 1 \
        --peers hf_batched --m 32 --batch-only                 # on a GPU (#45: >= 2x hf batched)

Same model weights, prompts and greedy settings for every row:
  * hf_generate: single-process GPT2LMHeadModel.generate (KV cache), one prompt at a time, timed
    in turn with the one-stage pipeline in the same process (same threads);
  * hf_generate_batched (--peers hf_batched): the same `generate` with all M prompts in one batch
    (left padding and its attention mask), the batch inference a Hugging Face user writes;
  * ct2_generate_batch (--peers ct2): CTranslate2's Generator.generate_batch over all M prompts on
    the folder `ct2-transformers-converter` makes of the same weights (float32, the same threads);
    the engine-speed reference for batch inference (peers.py; `pip install -e '.[bench]'`);
  * distlm S = 1, 2, 3 (mpiexec -n S): one prompt at a time (lanes = 1), then all M >= S prompts in
    flight together (lanes = M), in the same pipeline launch.
Each figure is the best of --repeats timed runs after one warm-up run (the machine may be shared).
--batch-only times the batch rows alone (the pipeline with all M prompts in flight, the batch
peers): `generate` one prompt at a time then runs once for each distinct prompt, untimed, as the
greedy reference, and the pipeline's one-at-a-time row is left out (on a GPU, where both are
launch-bound, they would take most of the run for figures no goal asks of it).
Every row's greedy token ids are compared with hf_generate's: the pipeline's must be equal (the run
fails after writing the JSON otherwise), the peers' are counted (batched kernels may break ties).
Targets (issue 6): S = 1 >= 0.8x hf_generate; S = 3 with M >= 3 in flight >= 1.5x S = 3 one at a time.
Target (issue 31): S = 1 with all M prompts in flight >= 1.5x hf_generate_batched.
Target (issue 45, --device cuda): S = 1 with all M prompts in flight >= 2x hf_generate_batched,
both on the GPU (`generate` and every pipeline rank on it; CTranslate2 stays a CPU peer here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py: the commit measured
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))  # peers.py: CTranslate2 and llama.cpp
sys.path.insert(0, str(ROOT / "tests"))  # harness.synthetic: the seeded model folder
from provenance import git_revision


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--model", help="model folder (default: a seeded init, see --layers/--embd)")
    p.add_argument("--prompts", default=str(ROOT / "config" / "prompts.txt"))
    p.add_argument(
        "--m", type=int, default=6, help="prompts in flight (cycled from the prompt file)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of hf_generate and of every pipeline rank (a shared machine "
        "punishes oversubscribed thread pools; the same count keeps rows comparable)",
    )
    p.add_argument(
        "--peers",
        default="hf_batched,ct2",
        help="batch-inference peers beside the one-stage pipeline (hf_batched, ct2; '' for none)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where generate and the pipeline's ranks run (runtime.device)",
    )
    p.add_argument(
        "--batch-only",
        action="store_true",
        help="time the batch rows alone; generate one prompt at a time is the untimed reference",
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    p.add_argument("--note", default="", help="what else ran on the machine (goes in the JSON)")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args()


# ----------------------------------------------------------------------------- model and prompts


def seeded_model(folder: Path, args, **arch) -> Path:
    """A seeded model with a tokenizer trained on the embedded corpus: GPT-2 architecture, or
    what `arch` (more model.init keys: architecture llama, n_kv_head, ...) says, built and written
    by the model stage's own functions (tests/harness/synthetic.py)."""
    from harness.synthetic import corpus_model_folder

    from distlm.settings import init_settings

    init = init_settings(
        n_positions=256,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        dropout=0.0,
        **arch,
    )
    return corpus_model_folder(folder, init, created_by="benchmark")


def serve_rank_threads(threads: int | None = None) -> int:
    """Intra-op threads for a probe's stage 0: `threads`, else what a one-stage serve job's rank
    takes here (the job's whole budget: OMP_NUM_THREADS, else the usable cores), set in torch."""
    import torch

    from distlm.runtime.host import threads_per_rank, usable_cpus

    threads = threads or threads_per_rank(os.environ, usable_cpus(), local_ranks=1, job_budget=True)
    torch.set_num_threads(threads)
    return threads


def sharded(model: Path, stages: int, work: Path) -> Path:
    """The model folder cut into a pipeline folder of `stages` shards (what rule shard does)."""
    from distlm.model import write_pipeline_dir

    out = work / f"s{stages}"
    if not out.exists():
        write_pipeline_dir(model, out, stages=stages)
    return out


def prompts(path: str, m: int) -> list[str]:
    from distlm.inference.prompts import read_prompts

    base = read_prompts(path)
    return [base[i % len(base)] for i in range(m)]


# ----------------------------------------------------------------------------- measurements

MODES = ("one_at_a_time", "in_flight")  # the pipeline's (in_flight alone with --batch-only)


def greedy_kwargs(n: int, tok) -> dict:
    """`generate`'s arguments for both HF runs: greedy, exactly n new tokens (no EOS stop, as in
    the pipeline runs), with the KV cache."""
    return {
        "max_new_tokens": n,
        "min_new_tokens": n,
        "do_sample": False,
        "use_cache": True,
        "pad_token_id": tok.eos_token_id,
    }


def hf_runner(model_dir: Path, texts: list[str], n: int, device: str = "cpu"):
    """A callable timing GPT2LMHeadModel.generate (KV cache) over the prompts, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType] (its decorated .to)
    ids = [
        torch.tensor([tok(t, add_special_tokens=False)["input_ids"]], device=device) for t in texts
    ]
    kw = greedy_kwargs(n, tok)

    def run() -> dict:
        t0, new = time.perf_counter(), []
        with torch.inference_mode():
            for x in ids:
                # transformers' GenerationMixin self-type protocol does not match GPT2LMHeadModel
                out = model.generate(x, **kw)  # pyright: ignore[reportAttributeAccessIssue]
                new.append(out[0, x.shape[1] :].tolist())
        wall = time.perf_counter() - t0
        total = sum(len(x) for x in new)
        return {
            "tokens": total,
            "wall_s": wall,
            "tokens_per_s": total / wall,
            "threads": torch.get_num_threads(),
            "token_ids": new,
        }

    return run


def hf_batched_runner(model_dir: Path, texts: list[str], n: int, device: str = "cpu"):
    """A callable timing GPT2LMHeadModel.generate over all prompts in one batch: left padding
    (with the EOS token, GPT-2 has no pad token) and the attention mask that hides it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType] (its decorated .to)
    batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
    kw = greedy_kwargs(n, tok)

    def run() -> dict:
        t0 = time.perf_counter()
        with torch.inference_mode():
            # transformers' GenerationMixin self-type protocol does not match GPT2LMHeadModel
            out = model.generate(**batch, **kw)  # pyright: ignore[reportAttributeAccessIssue]
        wall = time.perf_counter() - t0
        new = out[:, batch["input_ids"].shape[1] :].tolist()
        total = sum(len(x) for x in new)
        return {
            "tokens": total,
            "wall_s": wall,
            "tokens_per_s": total / wall,
            "threads": torch.get_num_threads(),
            "token_ids": new,
        }

    return run


def hf_reference(model_dir: Path, texts: list[str], n: int, device: str = "cpu") -> list:
    """`generate`'s greedy token ids of each prompt, one prompt at a time (hf_runner's), each
    distinct prompt once: the reference of --batch-only, untimed."""
    distinct = list(dict.fromkeys(texts))
    ids = dict(zip(distinct, hf_runner(model_dir, distinct, n, device)()["token_ids"], strict=True))
    return [ids[t] for t in texts]


def worker(spec_path: str, out_path: str) -> None:
    """Under mpiexec: one pipeline, timed one prompt at a time and with all prompts in flight.

    The modes (and, in the one-stage run, Hugging Face generate in the same process) take turns
    within each repeat, so a change in the machine's load hits them alike.
    """
    from distlm.inference.engine.batch import generate_batch
    from distlm.inference.engine.bootstrap import mpi_pipeline, run_workers
    from distlm.inference.engine.scheduler import Scheduler
    from distlm.settings import InferenceSettings

    spec = json.loads(Path(spec_path).read_text())
    icfg = InferenceSettings.model_validate(spec["inference"])
    with mpi_pipeline(icfg, spec["model"], device=spec["device"]) as pipe:
        if not run_workers(pipe):
            return

        def pipeline(lanes: int):
            def run() -> dict:
                pipe.scheduler = Scheduler(
                    pipe.model,
                    pipe.ring,
                    pipe.topo,
                    lanes=lanes,
                    eos_token_id=None,  # no EOS stop
                    context=pipe.context,
                    timeout_s=icfg.timeout_s,
                    stats=pipe.stats,
                )
                pipe.stats.reset()
                records, t = generate_batch(
                    pipe, spec["prompts"], icfg.model_copy(update={"lanes": lanes})
                )
                keep = ("lanes", "micro_batch_size", "prompts", "tokens", "wall_s", "tokens_per_s")
                return {
                    **{k: getattr(t, k) for k in keep},
                    "ttft_mean_s": t.ttft_s.mean,
                    "token_ids": [r["token_ids"] for r in records],
                }

            return run

        modes = {"in_flight": pipeline(len(spec["prompts"]))}
        if not spec["batch_only"]:
            modes = {"one_at_a_time": pipeline(1), **modes}
        reference = None
        if spec["hf"]:
            if spec["batch_only"]:
                reference = hf_reference(
                    spec["hf_model"], spec["prompts"], icfg.max_new_tokens, spec["device"]
                )
            else:
                modes["hf_generate"] = hf_runner(
                    spec["hf_model"], spec["prompts"], icfg.max_new_tokens, spec["device"]
                )
            if "hf_batched" in spec["peers"]:
                modes["hf_generate_batched"] = hf_batched_runner(
                    spec["hf_model"], spec["prompts"], icfg.max_new_tokens, spec["device"]
                )
            if "ct2" in spec["peers"]:
                from peers import ct2_runner
                from transformers import AutoTokenizer

                modes["ct2_generate_batch"] = ct2_runner(
                    Path(spec["ct2_model"]),
                    AutoTokenizer.from_pretrained(spec["hf_model"]),
                    spec["prompts"],
                    icfg.max_new_tokens,
                    spec["threads"],
                )
        runs = {name: [] for name in modes}
        for r in range(spec["repeats"] + 1):  # the first round is a warm-up
            for name, run in modes.items():
                res = run()
                if r:
                    runs[name].append(res)
        results = {name: max(rs, key=lambda x: x["tokens_per_s"]) for name, rs in runs.items()}
        for name, rs in runs.items():
            results[name]["all_tokens_per_s"] = [x["tokens_per_s"] for x in rs]
        if reference is not None:
            results["hf_generate"] = {"timed": False, "token_ids": reference}
        results["per_stage"] = pipe.stage0.stop()
        Path(out_path).write_text(json.dumps(results))


def distlm_run(
    model_dir: Path,
    stages: int,
    texts: list[str],
    n: int,
    repeats: int,
    work: Path,
    timeout: float,
    threads: int,
    hf_model: Path | None,
    peers: list[str],
    ct2_model: Path | None,
    device: str = "cpu",
    batch_only: bool = False,
) -> dict:
    from distlm.dag.config import validate_config

    icfg = validate_config(
        {"inference": {"stages": stages, "max_new_tokens": n, "temperature": 0.0, "timeout_s": 120}}
    )["inference"]
    spec = work / f"spec-{stages}.json"
    out = work / f"out-{stages}.json"
    spec.write_text(
        json.dumps(
            {
                "inference": icfg,
                "model": str(model_dir),
                "prompts": texts,
                "repeats": repeats,
                "hf": hf_model is not None,
                "hf_model": str(hf_model),
                "peers": peers,
                "ct2_model": str(ct2_model),
                "threads": threads,
                "device": device,
                "batch_only": batch_only,
            }
        )
    )
    cmd = ["mpiexec", "-n", str(stages), sys.executable, __file__, "--worker", str(spec), str(out)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads * stages),
    }  # the ranks share it out: `threads` each
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"distlm S={stages} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = parse()
    if args.worker:
        from distlm.core.log import setup_logging

        setup_logging()
        worker(*args.worker)
        return
    import torch

    from distlm.model import read_args

    work = Path(tempfile.mkdtemp(prefix="distlm-bench-"))
    try:
        model = Path(args.model) if args.model else seeded_model(work, args)
        texts = prompts(args.prompts, args.m)
        stages = [int(s) for s in args.stages.split(",")]
        if args.m < max(stages):
            raise SystemExit(
                f"--m {args.m}: need at least as many prompts as stages ({max(stages)})"
            )
        n = args.max_new_tokens
        peers = [x for x in args.peers.split(",") if x]
        unknown = sorted(set(peers) - {"hf_batched", "ct2"})
        if unknown:
            raise SystemExit(f"--peers: unknown {unknown} (known: hf_batched, ct2)")
        if args.device == "cuda" and "ct2" in peers:
            raise SystemExit(
                "--peers ct2 runs CTranslate2 on the CPU: with --device cuda name hf_batched"
            )
        ct2 = None
        if "ct2" in peers:
            from peers import ct2_model

            ct2 = ct2_model(model, work / "ct2")
        if 1 not in stages:
            raise SystemExit(
                "--stages must include 1: Hugging Face generate runs beside the one-stage pipeline"
            )
        rows = {}
        for s in stages:
            rows[str(s)] = distlm_run(
                sharded(model, s, work),
                s,
                texts,
                n,
                args.repeats,
                work,
                args.timeout,
                args.threads,
                model if s == 1 else None,
                peers,
                ct2,
                args.device,
                args.batch_only,
            )
            r = rows[str(s)]
            alone = (
                f"one at a time {r['one_at_a_time']['tokens_per_s']:.1f} tokens/s, "
                if "one_at_a_time" in r
                else ""
            )
            print(
                f"distlm S={s}: {alone}{args.m} in flight {r['in_flight']['tokens_per_s']:.1f} "
                "tokens/s",
                flush=True,
            )
        hf = rows["1"].pop("hf_generate")
        timed = hf.get("timed", True)
        peer_rows = {
            name: rows["1"].pop(name)
            for name in ("hf_generate_batched", "ct2_generate_batch")
            if name in rows["1"]
        }
        if timed:
            print(f"hf_generate: {hf['tokens_per_s']:.1f} tokens/s", flush=True)
        for name, r in peer_rows.items():
            print(f"{name}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
        # greedy token ids against hf_generate's: the pipeline's must be equal, peers' counted
        ref = hf.pop("token_ids")
        greedy, disagree = {}, []
        for label, r in [
            *((f"s{s}_{mode}", r[mode]) for s, r in rows.items() for mode in MODES if mode in r),
            *peer_rows.items(),
        ]:
            same = sum(a == b for a, b in zip(r.pop("token_ids"), ref, strict=True))
            greedy[label] = f"{same}/{len(ref)}"
            if label.startswith("s") and same != len(ref):
                disagree.append(label)
        cfg = read_args(model)
        ratios = {}
        if timed:
            ratios["s1_vs_hf_generate"] = (
                rows["1"]["one_at_a_time"]["tokens_per_s"] / hf["tokens_per_s"]
            )
        for s, r in rows.items():
            if "one_at_a_time" in r:
                ratios[f"s{s}_in_flight_vs_one_at_a_time"] = (
                    r["in_flight"]["tokens_per_s"] / r["one_at_a_time"]["tokens_per_s"]
                )
        for name, short in (("hf_generate_batched", "hf_batched"), ("ct2_generate_batch", "ct2")):
            if name not in peer_rows:
                continue
            for s, r in rows.items():
                ratios[f"s{s}_in_flight_vs_{short}"] = (
                    r["in_flight"]["tokens_per_s"] / peer_rows[name]["tokens_per_s"]
                )
        targets = {}
        if "s1_vs_hf_generate" in ratios:
            targets["s1 >= 0.8x hf_generate"] = ratios["s1_vs_hf_generate"] >= 0.8
        if "s3_in_flight_vs_one_at_a_time" in ratios:
            targets["s3 in flight >= 1.5x one at a time"] = (
                ratios["s3_in_flight_vs_one_at_a_time"] >= 1.5
            )
        if "s1_in_flight_vs_hf_batched" in ratios:
            goal = 2.0 if args.device == "cuda" else 1.5  # issue 45 on a GPU, issue 31 on the CPU
            targets[f"s1 in flight >= {goal}x hf_generate_batched"] = (
                ratios["s1_in_flight_vs_hf_batched"] >= goal
            )
        result = {
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "load_avg_1m": os.getloadavg()[0],
            },
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "model": {
                "folder": str(args.model or "seeded init"),
                "n_layer": cfg.n_layers,
                "n_embd": cfg.dim,
                "n_head": cfg.n_heads,
                "vocab_size": cfg.vocab_size,
            },
            "prompts": len(texts),
            "max_new_tokens": n,
            "repeats": args.repeats,
            "batch_only": args.batch_only,
            "threads": args.threads,
            "hf_generate": hf,
            **peer_rows,
            "distlm": rows,
            "greedy_equal_hf_generate": greedy,
            "ratios": ratios,
            "targets_met": targets,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "revision": git_revision(),  # the code measured (benchmarks/provenance.py)
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "note": args.note,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({"ratios": ratios, "targets_met": targets, "greedy": greedy}, indent=2))
        if disagree:
            raise SystemExit(f"greedy token ids differ from hf_generate's: {disagree} ({greedy})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
