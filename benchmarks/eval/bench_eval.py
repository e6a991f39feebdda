"""Sliding-window perplexity, side by side: the Hugging Face guide's loop against distlm.evaluate.

    python benchmarks/eval/bench_eval.py                       # embedded-default model size, CPU
    python benchmarks/eval/bench_eval.py --device cuda --n-layer 12 --n-head 12 --n-embd 768 \
        --n-positions 1024 --vocab 50257 --context 1024 --stride 512 --tokens 100000 --precision bf16

Both score the same random-init GPT-2-architecture weights on the same token stream (one process):
  guide   transformers' GPT2LMHeadModel, one window per forward, `model(input_ids, labels=...)`
          (full logits), as in the guide
  distlm  `score_windows` on distlm's GPT-2 (what the eval stage runs): `--batch-size` windows per
          forward, LM head only on scored positions
Writes JSON (default benchmarks/eval/results-<device>.json) with seconds, tokens/s, the speed-up,
and the relative difference of the two mean losses (same method, so it should be ~1e-6 in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from distlm.core.io import write_json
from distlm.evaluate import evaluate_stream, sliding_windows
from distlm.family import family_of
from distlm.model import init_model
from distlm.runtime.device import DeviceBackend, resolve_precision
from distlm.runtime.dist import Topology

T = TypeVar("T")


def guide_loop(
    model, ids: torch.Tensor, context: int, stride: int, device, amp
) -> tuple[float, int]:
    """The guide's code, with the exact token count (the guide's weights are off by one)."""
    nll, n, prev_end = 0.0, 0, 0
    seq_len = ids.numel()
    for begin in range(0, seq_len, stride):
        end = min(begin + context, seq_len)
        trg_len = end - prev_end
        input_ids = ids[begin:end][None].to(device)
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with (
            torch.no_grad(),
            torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None),
        ):
            loss = model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())
        nll += float(loss) * scored
        n += scored
        prev_end = end
        if end == seq_len:
            break
    return nll / n, n


def main() -> None:
    from transformers import GPT2Config

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--repeat", type=int, default=2, help="timed runs each (best is reported)")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    device = torch.device(a.device)
    hw = DeviceBackend(device, resolve_precision(a.precision, device, key="--precision"))
    amp = hw.autocast_dtype
    config = GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.n_positions,
        n_embd=a.n_embd,
        n_layer=a.n_layer,
        n_head=a.n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    # transformers wraps PreTrainedModel.to in a decorator whose stub loses `self`
    model = init_model(config, seed=0).to(device).eval()  # pyright: ignore[reportArgumentType]
    fam = family_of(config)
    args = fam.args(config.to_dict(), "bench_eval")
    ours = fam.build(args, device=device).eval()  # distlm's model of the same weights
    ours.load_hf(dict(model.named_parameters()), "bench_eval")
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, a.vocab, a.tokens), dtype=torch.long)
    topo = Topology(rank=0, world_size=1, local_rank=0, backend="gloo", device_backend=hw)
    sync = hw.synchronize

    def timed(fn: Callable[[], T]) -> tuple[float, T]:
        best, out = float("inf"), None
        for _ in range(a.repeat):
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            best = min(best, time.perf_counter() - t)
        if out is None:
            raise SystemExit(f"--repeat {a.repeat}: must be at least 1")
        return best, out

    t_guide, (loss_guide, n_guide) = timed(
        lambda: guide_loop(model, ids, a.context, a.stride, device, amp)
    )
    t_ours, res = timed(
        lambda: evaluate_stream(
            ours,
            ids,
            context=a.context,
            stride=a.stride,
            batch_size=a.batch_size,
            topo=topo,
            autocast_dtype=amp,
        )
    )
    assert res.tokens_scored == n_guide
    result = {
        "what": "sliding-window perplexity, one process: HF guide loop vs distlm.evaluate",
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_1min": os.getloadavg()[0],  # other work on the machine slows both sides alike
        "settings": vars(a),
        "windows": len(sliding_windows(a.tokens, a.context, a.stride)),
        "tokens_scored": n_guide,
        "guide": {
            "seconds": round(t_guide, 4),
            "tokens_per_s": round(n_guide / t_guide, 1),
            "mean_loss": loss_guide,
        },
        "distlm": {
            "seconds": round(t_ours, 4),
            "tokens_per_s": round(n_guide / t_ours, 1),
            "mean_loss": res.mean_loss,
        },
        "speedup": round(t_guide / t_ours, 3),
        "loss_rel_diff": abs(res.mean_loss - loss_guide) / abs(loss_guide),
    }
    out = Path(a.out or Path(__file__).with_name(f"results-{device.type}.json"))
    write_json(out, result)
    print(
        json.dumps(
            {k: result[k] for k in ("guide", "distlm", "speedup", "loss_rel_diff")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
