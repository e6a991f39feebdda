"""One decode step of a serving stage, timed three ways on the same rows: the eager step
(`StageModel.forward`, what the CPU serves with), the static step (`StaticStep.forward`, the
body a GPU captures as a CUDA graph, over the positions its rows hold rounded up) and the
static step under `torch.compile` (inductor; `--freezing` folds the weights in as constants, on
the CPU oneDNN's prepacked layout). Also the decode's attention call alone over one layer's
cache, hot (called again and again: its keys and values stay in the CPU's caches) and cold (64
MB written between calls), times the layers: in the step, each layer's call reads them after
the others' work.

    python benchmarks/inference/probe_decode_step.py --model results/train/final --rows 16,64
    python benchmarks/inference/probe_decode_step.py --rows 64 --freezing

R rows on lanes 0..R-1, each with --pos cached positions, one new token each; one stage holding
the whole model; the intra-op threads a one-stage serve job's rank takes here, or --threads.
The static steps' times hold the loading of their inputs (`StaticStep.load`), as a replay's
does. Prints milliseconds a step (the median of --repeats timings of --steps steps), the
compile's seconds (with what inductor's cache on this machine already held) and the largest
difference of the compiled step's output from the static step's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "results" / "train" / "final")
    p.add_argument("--rows", default="16,64", help="decode rows a step, comma-separated")
    p.add_argument("--pos", type=int, default=60, help="cached positions of every row")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--freezing", action="store_true", help="inductor's freezing for the compile")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(1, str(Path(__file__).parent))

    import torch
    import torch.nn.functional as F
    from bench import serve_rank_threads, sharded

    from distlm.inference.engine import pipeline_stage as stage
    from distlm.inference.engine.graphs import DecodeGraphs, StaticStep
    from distlm.inference.engine.micro_batch import Item
    from distlm.runtime.device import DeviceBackend

    threads = serve_rank_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    print(f"{dev}, {threads} intra-op threads, {args.pos} cached positions a row")

    def ms(f) -> float:
        for _ in range(10):
            f()
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                f()
            sync()
            times.append((time.perf_counter() - t0) / args.steps * 1e3)
        return statistics.median(times)

    with tempfile.TemporaryDirectory(prefix="distlm-probe-") as tmp:
        hw = DeviceBackend(dev, decode_graphs=False, capture_graphs=False)
        model = stage.load_stage(sharded(args.model, 1, Path(tmp)), 0, world=1, hw=hw)
        evict = torch.zeros(16 << 20, device=dev)  # 64 MB, written between cold calls
        for R in (int(r) for r in args.rows.split(",")):
            with torch.inference_mode():
                model.kv.clear()
                model._reserve(R - 1, args.pos + 1)
                items = [Item(seq=lane, lane=lane, pos=args.pos, n=1) for lane in range(R)]
                x = torch.randint(0, model.args.vocab_size, (R,), device=dev)

                def eager(items=items, x=x) -> None:
                    for it in items:
                        model.length[it.lane] = it.pos
                    model.forward(items, x)

                static = StaticStep(model, 0, R, DecodeGraphs(model, capture=False).span(items))
                static.load(items, x)
                t0 = time.perf_counter()
                compiled = torch.compile(static.forward, dynamic=False)
                out = compiled()
                sync()
                compile_s = time.perf_counter() - t0
                diff = (out - static.forward()).abs().max().item()

                def static_step(static=static, items=items, x=x) -> None:
                    static.load(items, x)  # the step's inputs, as each replay takes them
                    static.forward()

                def compiled_step(static=static, items=items, x=x, compiled=compiled) -> None:
                    static.load(items, x)
                    compiled()

                cache = model.kv[0]
                q = torch.randn(R, model.n_head, 1, model.head_dim, device=dev, dtype=model.dtype)
                mask = static.mask[..., : args.pos + 1]

                def attend(cache=cache, q=q, mask=mask) -> None:
                    T = mask.shape[-1]
                    F.scaled_dot_product_attention(
                        q, cache[:, 0, :, :T], cache[:, 1, :, :T], attn_mask=mask
                    )

                def cold(attend=attend) -> float:
                    """The call's milliseconds after a write of 64 MB between calls (the
                    keys and values out of the CPU's caches, as the step's other work leaves
                    them), the median of --steps calls."""
                    times = []
                    for _ in range(args.steps):
                        evict.add_(1)
                        sync()
                        t0 = time.perf_counter()
                        attend()
                        sync()
                        times.append((time.perf_counter() - t0) * 1e3)
                    return statistics.median(times)

                layers = len(model.kv)
                print(
                    f"{R} rows: eager {ms(eager):.3f} ms, static {ms(static_step):.3f} ms, "
                    f"compiled {ms(compiled_step):.3f} ms (compile {compile_s:.1f} s, max diff "
                    f"{diff:.1e}); attention alone, hot, x {layers} layers: "
                    f"{ms(attend) * layers:.3f} ms, cold {cold() * layers:.3f} ms"
                )


if __name__ == "__main__":
    main()
