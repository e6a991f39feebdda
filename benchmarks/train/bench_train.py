"""Training throughput: distlm's training step against a minimal plain DDP loop, side by side.

    python benchmarks/train/bench_train.py                       # CPU, 2 ranks, embedded default model
    python benchmarks/train/bench_train.py --preset gpt2 --nproc 1 --device cuda --precision bf16
    python benchmarks/train/bench_train.py --out benchmarks/train/results-cpu.json

The script starts itself under torchrun. In the same processes, on the same model, batch and
world size, it alternates rounds of (a) distlm's step (`Trainer.step_and_log`: HDF5 sampler, grad
accumulation scaffolding, clipping, fused AdamW, schedule, NaN check, metrics; no checkpoint) and
(b) the minimal loop (DDP defaults, AdamW, forward, backward, step, zero_grad on one in-memory
batch). Alternating rounds spreads noise from other load evenly. It writes JSON with the median
tokens/s of each, their ratio (target >= 0.95 on the CPU) and, on a GPU, the model FLOPs
utilisation (nanoGPT's estimate) against the device's peak from PEAK_FLOPS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = {
    # the embedded default (config/config.yaml): 4 layers, 128 wide, 4096 tokens, block 128
    "default": {
        "vocab": 4096,
        "block_size": 128,
        "n_layer": 4,
        "n_head": 4,
        "n_embd": 128,
        "micro_batch": 8,
    },
    # GPT-2 small (124M) at its full context
    "gpt2": {
        "vocab": 50257,
        "block_size": 1024,
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "micro_batch": 16,
    },
}

# Dense peak FLOP/s (no sparsity) per device, by a substring of torch.cuda.get_device_name().
PEAK_FLOPS = {
    "bf16": [
        ("H200", 989e12),
        ("H100 PCIe", 756e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("L40S", 362e12),
        ("A10G", 70e12),
        ("L4", 121e12),
        ("RTX 4090", 165e12),
    ],
    "fp16": [
        ("H200", 989e12),
        ("H100 PCIe", 756e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("V100", 125e12),
        ("L40S", 362e12),
        ("T4", 65e12),
    ],
    "fp32": [("H200", 67e12), ("H100", 67e12), ("A100", 19.5e12), ("V100", 15.7e12)],
}


def peak_flops(name: str, precision: str) -> float | None:
    for key, flops in PEAK_FLOPS.get(precision, []):
        if key in name:
            return flops
    return None


def flops_per_token(n_params_no_pos: int, n_layer: int, n_head: int, n_embd: int, T: int) -> float:
    """nanoGPT's estimate (PaLM appendix B): 6N + 12 L H Q T per token, forward and backward."""
    return 6 * n_params_no_pos + 12 * n_layer * n_head * (n_embd // n_head) * T


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distlm.config import validate_config
    from distlm.stages import stage_config
    from distlm.dist import distributed
    from distlm.log import setup_logging
    from distlm.model import load_model_dir
    from distlm.train import Trainer, TrainPaths
    from distlm.train.synthetic import make_inputs

    setup_logging(None, level=30)  # warnings only: the loop's log lines would be noise here
    p = PRESETS[a.preset]
    cfg = validate_config(
        {
            "runtime": {
                "device": a.device,
                "backend": "nccl" if a.device == "cuda" else "gloo",
                "timeout_s": 600,
            },
            "broadcast": {"bucket_mb": 64},
            "train": {
                "micro_batch_size": p["micro_batch"],
                "max_steps": 10**6,
                "warmup_steps": 10,
                "lr": 3e-4,
                "min_lr": 3e-5,
                "precision": a.precision,
                "compile": a.compile,
                "log_every": 10**6,
                "ckpt_every": 10**6,
                "eval_every": 10**6,
            },
        }
    )
    cfg = stage_config(cfg, "train")
    with distributed(backend=cfg["runtime"]["backend"], device=a.device, timeout_s=600) as topo:
        root = Path(a.workdir)
        with topo.main_first():
            if topo.is_main:
                make_inputs(
                    root,
                    vocab=p["vocab"],
                    block_size=p["block_size"],
                    n_layer=p["n_layer"],
                    n_head=p["n_head"],
                    n_embd=p["n_embd"],
                    train_blocks=max(256, 4 * p["micro_batch"] * topo.world_size),
                    val_blocks=8,
                )
        paths = TrainPaths(
            tokens=root / "tokens.h5",
            model=root / "model",
            tokenizer=root / "tokenizer",
            out=root / f"out-{os.getpid()}",
        )
        trainer = Trainer(cfg, paths, topo).setup()

        # the minimal loop: same architecture and weights, defaults everywhere
        plain = load_model_dir(root / "model", device=topo.device).train()
        plain.loss_type = "ForCausalLM"
        plain_ddp = DDP(
            plain, device_ids=[topo.device.index] if topo.device.type == "cuda" else None
        )
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4)
        g = torch.Generator().manual_seed(topo.rank)
        batch = torch.randint(0, p["vocab"], (p["micro_batch"], p["block_size"]), generator=g).to(
            topo.device
        )
        amp = (
            torch.autocast(topo.device.type, dtype=trainer.autocast_dtype)
            if trainer.autocast_dtype is not None
            else contextlib.nullcontext()
        )

        def plain_step():
            with amp:
                loss = plain_ddp(input_ids=batch, labels=batch).loss
            loss.backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)

        def sync():
            if topo.device.type == "cuda":
                torch.cuda.synchronize(topo.device)
            dist.barrier()

        def timed(fn, n) -> tuple[float, float]:
            """(wall seconds, CPU seconds summed over ranks) of n calls."""
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                fn()
            sync()
            cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(
                cpu
            )  # gloo: CPU tensor; nccl runs on GPUs, where wall time is what counts
            return time.perf_counter() - t0, cpu.item()

        tokens_per_step = trainer.tokens_per_step
        for fn in (trainer.step_and_log, plain_step):
            timed(fn, a.warmup)
        rounds = {"distlm": [], "plain": []}
        cpu_rounds = {"distlm": [], "plain": []}
        for r in range(a.rounds):
            order = [("distlm", trainer.step_and_log), ("plain", plain_step)]
            if r % 2:
                order.reverse()  # alternate who goes first
            for name, fn in order:
                wall, cpu = timed(fn, a.steps)
                rounds[name].append(a.steps * tokens_per_step / wall)
                cpu_rounds[name].append(a.steps * tokens_per_step / cpu)

        if topo.is_main:
            med = {k: statistics.median(v) for k, v in rounds.items()}
            n_params = sum(t.numel() for t in plain.parameters())
            n_pos = plain.transformer.wpe.weight.numel()
            fpt = flops_per_token(
                n_params - n_pos, p["n_layer"], p["n_head"], p["n_embd"], p["block_size"]
            )
            result = {
                "benchmark": "train step throughput: distlm vs minimal DDP loop",
                "device": torch.cuda.get_device_name(topo.device)
                if topo.device.type == "cuda"
                else "cpu",
                "torch": torch.__version__,
                "world_size": topo.world_size,
                "threads_per_rank": torch.get_num_threads(),
                "preset": a.preset,
                "model": {
                    **{k: p[k] for k in ("vocab", "n_layer", "n_head", "n_embd")},
                    "parameters": n_params,
                },
                "block_size": p["block_size"],
                "micro_batch_per_rank": p["micro_batch"],
                "global_batch": trainer.plan.global_batch,
                "tokens_per_step": tokens_per_step,
                "precision": trainer.precision,
                "compile": a.compile,
                "steps_per_round": a.steps,
                "rounds": a.rounds,
                "tokens_per_s": {"distlm": med["distlm"], "plain_ddp": med["plain"]},
                "tokens_per_s_rounds": rounds,
                # tokens per CPU-second of all ranks: the work each loop does, far less sensitive
                # than wall time to other load on a shared machine
                "tokens_per_cpu_s": {k: statistics.median(v) for k, v in cpu_rounds.items()},
                "ratio_cpu_time": statistics.median(cpu_rounds["distlm"])
                / statistics.median(cpu_rounds["plain"]),
                "ratio_distlm_over_plain": med["distlm"] / med["plain"],
                # each round's pair ran back to back: the median of their ratios is robust to load drift
                "ratio_paired_median": statistics.median(
                    d / q for d, q in zip(rounds["distlm"], rounds["plain"])
                ),
                "target_ratio_cpu": 0.95,
            }
            if topo.device.type == "cuda":
                peak = peak_flops(result["device"], trainer.precision)
                per_dev = fpt * med["distlm"] / topo.world_size
                result["mfu"] = {
                    "flops_per_token": fpt,
                    "peak_flops_per_device": peak,
                    "distlm": per_dev / peak if peak else None,
                    "plain_ddp": fpt * med["plain"] / topo.world_size / peak if peak else None,
                    "note": None if peak else "device not in PEAK_FLOPS",
                }
            else:
                result["mfu"] = None  # no meaningful peak figure for a shared CPU
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
            print(
                json.dumps(
                    {
                        k: result[k]
                        for k in (
                            "device",
                            "world_size",
                            "tokens_per_s",
                            "ratio_distlm_over_plain",
                            "ratio_paired_median",
                            "ratio_cpu_time",
                            "mfu",
                        )
                    },
                    indent=2,
                )
            )
        trainer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=4, help="steps per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results-cpu.json")))
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    if "RANK" in os.environ:
        worker(a)
        return
    with tempfile.TemporaryDirectory(prefix="distlm-bench-train-") as tmp:
        args = [a for a in sys.argv[1:]] + ([] if a.workdir else ["--workdir", tmp])
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={a.nproc}",
            __file__,
            *args,
        ]
        sys.exit(subprocess.call(cmd, timeout=3600))


if __name__ == "__main__":
    main()
