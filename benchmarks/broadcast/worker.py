"""One rank of the broadcast benchmark (started by run.py, on loopback or inside a fabric namespace).

Runs every method on the same GPT-2-124M-shaped state dict and prints one JSON line per method:
    seed    per tensor, receiver after receiver (dist.send/recv): the seed system's method
    flat    pack into one flat buffer, the backend's dist.broadcast, unpack (buffer preallocated)
    distlm  distlm.transfer.broadcast_state_dict (buckets, chain, checksums)
Time of a method = from a barrier to the moment the last receiver holds its tensors (ranks share
the host clock, also across namespaces). Peak RSS per rank is reset before each method.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from distlm.runtime.dist import distributed
from distlm.settings import TransferSettings
from distlm.transfer import broadcast_state_dict


def gpt2_shapes(n_layer=12, n_embd=768, vocab=50257, n_pos=1024) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, n_embd),
        "transformer.wpe.weight": (n_pos, n_embd),
    }
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        s.update(
            {
                p + "ln_1.weight": (n_embd,),
                p + "ln_1.bias": (n_embd,),
                p + "attn.c_attn.weight": (n_embd, 3 * n_embd),
                p + "attn.c_attn.bias": (3 * n_embd,),
                p + "attn.c_proj.weight": (n_embd, n_embd),
                p + "attn.c_proj.bias": (n_embd,),
                p + "ln_2.weight": (n_embd,),
                p + "ln_2.bias": (n_embd,),
                p + "mlp.c_fc.weight": (n_embd, 4 * n_embd),
                p + "mlp.c_fc.bias": (4 * n_embd,),
                p + "mlp.c_proj.weight": (4 * n_embd, n_embd),
                p + "mlp.c_proj.bias": (n_embd,),
            }
        )
    s.update({"transformer.ln_f.weight": (n_embd,), "transformer.ln_f.bias": (n_embd,)})
    return s


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fingerprint(sd: dict[str, torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int32).sum()) for t in sd.values()]


def seed_method(topo, sd):
    for r in range(1, topo.world_size):
        for t in sd.values():
            if topo.is_main:
                dist.send(t, r)
            elif topo.rank == r:
                dist.recv(t, 0)


def flat_method(topo, sd, flat, timing):
    if topo.is_main:
        torch.cat([t.reshape(-1) for t in sd.values()], out=flat)
    t = time.perf_counter()
    dist.broadcast(flat, 0)
    timing["broadcast_only_s"] = time.perf_counter() - t
    if not topo.is_main:
        off = 0
        for v in sd.values():
            v.reshape(-1).copy_(flat[off : off + v.numel()])
            off += v.numel()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", nargs="+", default=["distlm", "seed", "flat"])
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--chunk-mb", type=float, default=4)
    p.add_argument(
        "--scale", type=float, default=1.0, help="vocab and layers scaled down for quick runs"
    )
    p.add_argument("--timeout-s", type=float, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    n_layer = max(1, round(12 * args.scale))
    shapes = gpt2_shapes(n_layer=n_layer, vocab=max(1024, int(50257 * args.scale)))
    with distributed(backend="gloo", timeout_s=args.timeout_s) as topo:
        g = torch.Generator().manual_seed(0)
        if topo.is_main:
            sd = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        else:
            sd = {k: torch.zeros(s) for k, s in shapes.items()}  # touched: first-touch is not timed
        ref = fingerprint(sd) if topo.is_main else None
        nbytes = sum(t.numel() * 4 for t in sd.values())
        for method in args.methods:
            extra = {}
            flat = None
            if method == "flat":
                flat = torch.zeros(sum(t.numel() for t in sd.values()))
            if not topo.is_main:
                for t in sd.values():
                    t.zero_()
            reset_peak()
            dist.barrier()
            t0 = time.time()
            if method == "seed":
                seed_method(topo, sd)
            elif method == "flat":
                flat_method(topo, sd, flat, extra)
            elif method == "distlm":
                settings = TransferSettings(
                    bucket_mb=args.bucket_mb, chunk_mb=args.chunk_mb, timeout_s=args.timeout_s
                )
                res = broadcast_state_dict(sd, settings=settings)  # receivers: filled in place
                extra = {
                    k: getattr(res.stats, k) for k in ("buckets", "checksum_seconds", "verified")
                }
                extra["unpack_seconds"] = res.stats.unpack_seconds
            t1 = time.time()
            peak = peak_mb()
            del flat
            # Correctness, outside the timed region: every receiver holds the sender's bits.
            fp = torch.tensor(fingerprint(sd), dtype=torch.int64)
            got: list[Any] = [None] * topo.world_size  # filled by all_gather_object
            dist.all_gather_object(
                got,
                {
                    "rank": topo.rank,
                    "t0": t0,
                    "t1": t1,
                    "peak_mb": peak,
                    "fp": fp.tolist(),
                    **extra,
                },
            )
            if topo.is_main:
                ok = all(g_["fp"] == ref for g_ in got[1:])
                start = got[0]["t0"]
                print(
                    json.dumps(
                        {
                            "method": method,
                            "receivers": topo.world_size - 1,
                            "bytes": nbytes,
                            "tensors": len(sd),
                            "seconds": max(g_["t1"] for g_ in got[1:]) - start,
                            "correct": ok,
                            "per_rank": [
                                {k: v for k, v in g_.items() if k not in ("fp", "t0")}
                                | {"t1": g_["t1"] - start}
                                for g_ in got
                            ],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(main())
