"""Where batch inference's time goes: the one-stage pipeline with all prompts in flight, or Hugging
Face `generate` batched, run over and over on bench.py's seeded model, under a profiler.

    mpiexec -n 1 python benchmarks/inference/profile_batch.py pipeline --torch   # torch.profiler
    python benchmarks/inference/profile_batch.py generate --torch
    py-spy record -r 250 -f raw -o spy.txt --subprocesses -- \
        mpiexec -n 1 python benchmarks/inference/profile_batch.py pipeline --runs 30

The same model, prompts (--m of config/prompts.txt) and thread as bench.py's rows (--threads 1);
three warm-up runs, then --runs timed ones. --torch prints torch.profiler's
operator table (self CPU time) and the wall time it covered; without it the runs are bare, for
py-spy to sample.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("mode", choices=["pipeline", "generate"])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--torch", action="store_true", help="under torch.profiler")
    p.add_argument("--m", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the pipeline rank's budget (bootstrap)

    import torch
    from bench import hf_batched_runner, prompts, seeded_model, sharded

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="distlm-profile-") as tmp:
        work = Path(tmp)
        model = seeded_model(work, args)
        texts = prompts(str(ROOT / "config" / "prompts.txt"), args.m)
        if args.mode == "generate":
            run = hf_batched_runner(model, texts, args.max_new_tokens)
            profile(run, args)
            return
        from distlm.dag.config import validate_config
        from distlm.inference.engine.batch import generate_batch
        from distlm.inference.engine.bootstrap import mpi_pipeline, run_workers
        from distlm.inference.engine.scheduler import Scheduler
        from distlm.settings import InferenceSettings

        icfg = InferenceSettings.model_validate(
            validate_config(
                {
                    "inference": {
                        "stages": 1,
                        "lanes": args.m,
                        "max_new_tokens": args.max_new_tokens,
                        "temperature": 0.0,
                    }
                }
            )["inference"]
        )
        with mpi_pipeline(icfg, str(sharded(model, 1, work))) as pipe:
            if not run_workers(pipe):
                return

            def run() -> dict:
                pipe.scheduler = Scheduler(
                    pipe.model,
                    pipe.ring,
                    pipe.topo,
                    lanes=args.m,
                    eos_token_id=None,  # no EOS stop, as bench.py
                    context=pipe.context,
                    timeout_s=icfg.timeout_s,
                    stats=pipe.stats,
                )
                _, t = generate_batch(pipe, texts, icfg)
                return {"tokens_per_s": t.tokens_per_s}

            profile(run, args)
            pipe.stage0.stop()


def profile(run, args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        print("warm-up", run()["tokens_per_s"], "tokens/s", flush=True)
    t0 = time.perf_counter()
    if args.torch:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.runs):
                run()
        wall = time.perf_counter() - t0
        ops = prof.key_averages()
        self_s = sum(e.self_cpu_time_total for e in ops) / 1e6
        print(f"{args.runs} runs: wall {wall:.3f} s under the profiler, operators {self_s:.3f} s")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=25))
    else:
        for _ in range(args.runs):
            run()
        wall = time.perf_counter() - t0
        print(f"{args.runs} runs: wall {wall:.3f} s")


if __name__ == "__main__":
    main()
