"""The serving engine's steps without HTTP: stage 0's real Scheduler and stage, fed by N
simulated clients that each send a greedy request again one step after the last one ended
(starts staggered), so that sequences end and lanes are reused as when serving.

    python benchmarks/inference/probe_serve_steps.py --model results/train/final --clients 16
    python benchmarks/inference/probe_serve_steps.py --model results/train/final --src ../old/src
    python benchmarks/inference/probe_serve_steps.py --clients 64 --steps-in-flight 2
    python benchmarks/inference/probe_serve_steps.py --clients 64 --threads 1

Stage 0 runs on the intra-op threads a one-stage serve job's rank takes here (the job's whole
budget: OMP_NUM_THREADS, else the usable cores, as `Topology.share_threads` derives it), or on
--threads. Prints the tokens/s of each timed run (--runs of --steps scheduler steps, after one
warm-up run) and how the decode items of the micro-batches were attended (stage._Decode):
`whole` (only decodes, lanes in order: queries and outputs as they lie), `aligned` (the same,
prefills after them), `picked` (rows picked by index: a lane between them has no decode item,
or the order is another), `single` (one sequence alone), `prefill-only`. `--src` imports distlm
from another checkout's src, to compare two versions back to back on the same machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "results" / "train" / "final")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lanes", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--src", type=Path, default=ROOT / "src", help="the distlm to import")
    p.add_argument(
        "--steps-in-flight",
        type=int,
        default=None,
        help="micro-batches on the device at once (inference.steps_in_flight; default 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="stage 0's intra-op threads (default: a one-stage serve job's rank's, here)",
    )
    args = p.parse_args()
    sys.path.insert(0, str(args.src.resolve()))
    sys.path.insert(1, str(Path(__file__).parent))

    import tempfile

    import torch
    from transformers import AutoTokenizer

    from distlm.inference.engine import pipeline_stage as stage
    from distlm.inference.engine.scheduler import Scheduler, Sequence
    from distlm.inference.sampling_params import SamplingParams
    from distlm.inference.stats import StageStats
    from distlm.runtime.dist import MPI_RING, Topology

    print(f"distlm from {Path(stage.__file__).parents[3]}")
    # bench.py puts this checkout's src first on the path: imported after distlm, it cannot
    # change which distlm runs
    from bench import prompts, serve_rank_threads, sharded

    threads = serve_rank_threads(args.threads)
    print(f"stage 0 on {threads} intra-op threads")
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = prompts(str(ROOT / "config" / "prompts.txt"), args.clients)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    paths: collections.Counter[str] = collections.Counter()

    class CountingPlan(stage._Plan):
        def __init__(self, items, dev, *rest) -> None:
            super().__init__(items, dev, *rest)
            d = getattr(self, "decode", None)
            if self.single is not None:
                paths["single"] += 1
            elif d is None:
                paths["prefill-only"] += 1
            else:
                aligned = getattr(d, "aligned", d.whole)
                paths["whole" if d.whole else "aligned" if aligned else "picked"] += 1

    stage._Plan = CountingPlan

    with tempfile.TemporaryDirectory(prefix="distlm-probe-") as tmp:
        hw = None
        if args.steps_in_flight is not None:
            from distlm.runtime.device import DeviceBackend

            hw = DeviceBackend(torch.device("cpu"), steps_in_flight=args.steps_in_flight)
        model = stage.load_stage(sharded(args.model, 1, Path(tmp)), 0, world=1, hw=hw)

        def run(steps: int) -> float:
            sched = Scheduler(
                model,
                None,
                Topology.single(hw, backend=MPI_RING),
                lanes=args.lanes,
                eos_token_id=None,  # every request runs its max_tokens
                context=model.context,
                timeout_s=10,
                stats=StageStats(0),
            )
            submit_at = {c: 2 * c for c in range(args.clients)}
            live: dict[int, Sequence] = {}
            tokens, n = 0, 0
            t0 = time.perf_counter()
            for step in range(steps):
                for c, at in list(submit_at.items()):
                    if step >= at:
                        seq = Sequence(
                            sched.new_id(), ids[n % len(ids)], SamplingParams(args.max_tokens)
                        )
                        n += 1
                        sched.submit(seq)
                        live[c] = seq
                        del submit_at[c]
                sched.step()
                for c, seq in list(live.items()):
                    if seq.finish_reason is not None:
                        tokens += len(seq.tokens)
                        del live[c]
                        submit_at[c] = step + 1
            return tokens / (time.perf_counter() - t0)

        with torch.inference_mode():
            run(args.steps // 6)  # warm-up
            paths.clear()
            rates = sorted(run(args.steps) for _ in range(args.runs))
    print(f"decode paths over {args.runs} runs of {args.steps} steps: {dict(paths)}")
    print(
        f"tokens/s: median {rates[len(rates) // 2]:.0f}, best {rates[-1]:.0f} "
        f"({', '.join(f'{r:.0f}' for r in rates)})"
    )


if __name__ == "__main__":
    main()
