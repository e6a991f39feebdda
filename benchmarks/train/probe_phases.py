"""Where a training step's time goes: the stage's run_training under torchrun, timed by phase.

    OMP_NUM_THREADS=1 PHASES=1 torchrun --standalone --nproc-per-node=2 \
        benchmarks/train/probe_phases.py /tmp/probe train.max_steps=60 train.profile.enabled=false

Reads config/config.yaml and the workflow's results/data and results/model/base (dotted KEY=JSON
overrides follow the output folder). With PHASES=1 the step is replaced by an instrumented copy of
`Trainer.train_step` (one micro-batch: data, forward, backward with the all-reduce, clipping,
loss all-reduce, optimizer, zero_grad and schedule), and `step_and_log`'s bookkeeping (metrics,
TensorBoard, progress bar, log line) is timed as the rest. Rank 0 prints the stage's median, p90
and mean from metrics.csv, steps 11 on. With GELU=cpp the stage's tanh GELUs are the
hand-written C++ loop of `gelu_cpp.py` (an experiment; needs a C++ compiler and ninja). A
diagnostic, not the benchmark (bench_train.py).
"""

import argparse
import json
import math
import os
import statistics as st
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlm.config import load_config
from distlm.log import setup_logging
from distlm.settings.stage import TrainConfig
from distlm.stages import stage_config
from distlm.train import TrainPaths, run_training
from distlm.train import trainer as T
from distlm.train.optim import clip_gradients, grad_norm

parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
parser.add_argument("out", type=Path, help="output folder (the training stage's results/train)")
parser.add_argument(
    "overrides",
    nargs="*",
    metavar="KEY=JSON",
    help="dotted config override, e.g. train.max_steps=60; env.threads=N sets torch's threads",
)
parser.add_argument("--config", default="config/config.yaml", help="workflow config file")
args = parser.parse_args()
out: Path = args.out
overrides: dict = {}
env = {}
for kv in args.overrides:
    k, v = kv.split("=", 1)
    v = json.loads(v)
    if k.startswith("env."):
        env[k[4:]] = v
        continue
    d = overrides
    *ks, last = k.split(".")
    for kk in ks:
        d = d.setdefault(kk, {})
    d[last] = v
# the stage's typed config, as the resolve_config rule writes it for every rank
cfg = TrainConfig.of(stage_config(load_config(args.config, overrides), "train"))
PH = os.environ.get("PHASES") == "1"
if os.environ.get("GELU") == "cpp":
    import gelu_cpp  # beside this script

    from distlm.train import ddp as ddp_mod

    fuse = ddp_mod.fuse_gelu

    def fuse_then_swap(model: torch.nn.Module) -> int:
        n = fuse(model)
        assert gelu_cpp.swap_into(model) == n, "not every tanh GELU was swapped"
        return n

    ddp_mod.fuse_gelu = fuse_then_swap
if env.get("threads"):
    torch.set_num_threads(int(env["threads"]))
phases = {}


def tick(name, t0):
    t = time.perf_counter()
    phases.setdefault(name, []).append(t - t0)
    return t


if PH:
    orig_step = T.Trainer.train_step

    def train_step(self):
        t0 = time.perf_counter()
        t_start = t0
        step = self.step
        micro = self.data.loader(step)
        t0 = tick("data", t0)
        lr = self.optimizer.param_groups[0]["lr"]
        x = micro[0]
        loss = self.ddp(x)
        t0 = tick("fwd", t0)
        loss.backward()
        t0 = tick("bwd+allreduce", t0)
        # the trainer's clipping (distlm.train.optim): the norm, and the pass only if it clips
        clip = self.tcfg.grad_clip if self.tcfg.grad_clip > 0 else float("inf")
        gnorm = grad_norm(self.model)
        gv = gnorm.item()
        clip_gradients(self.model, clip, gnorm)
        t0 = tick("clip", t0)
        lr_ = loss.detach().reshape(1)
        dist.all_reduce(lr_)
        t0 = tick("loss_allreduce", t0)
        self.optimizer.step()
        t0 = tick("optim", t0)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        t0 = tick("zero+sched", t0)
        lv = lr_.item() / 2
        self.step = step + 1
        dt = time.perf_counter() - t_start
        phases.setdefault("train_step_total", []).append(dt)
        return {
            "step": self.step,
            "loss": lv,
            "perplexity": math.exp(lv),
            "grad_norm": gv,
            "lr": lr,
            "tokens": self.step * self.data.tokens_per_step,
            "tokens_per_s": self.data.tokens_per_step / dt,
            "step_time_s": dt,
        }

    T.Trainer.train_step = train_step
    orig_sal = T.Trainer.step_and_log

    def sal(self, **kw):
        t0 = time.perf_counter()
        r = orig_sal(self, **kw)
        tot = time.perf_counter() - t0
        phases.setdefault("step_and_log_total", []).append(tot)
        phases.setdefault("bookkeeping", []).append(tot - phases["train_step_total"][-1])
        return r

    T.Trainer.step_and_log = sal
setup_logging(str(out / "rank{rank}.log"), level=30)
t0 = time.perf_counter()
run_training(
    cfg,
    TrainPaths(
        tokens=Path("results/data/tokens.h5"),
        model=Path("results/model/base"),
        tokenizer=Path("results/data/tokenizer"),
        out=out,
    ),
)
wall = time.perf_counter() - t0
rank = int(os.environ.get("RANK", "0"))
if PH:
    print(
        f"rank{rank} phases ms (median over steps 11+):",
        {k: round(1000 * st.median(v[10:]), 1) for k, v in phases.items()},
        flush=True,
    )
if rank == 0:
    import csv

    with (out / "metrics.csv").open() as f:
        r = list(csv.DictReader(f))
    t = [float(x["step_time_s"]) for x in r][10:]
    s = sorted(t)
    print(
        json.dumps(
            {
                "args": args.overrides,
                "omp": os.environ.get("OMP_NUM_THREADS"),
                "threads": torch.get_num_threads(),
                "steps": len(t),
                "median_ms": round(1000 * st.median(s), 1),
                "p90_ms": round(1000 * s[int(0.9 * len(s))], 1),
                "mean_tok_s": round(2048 * len(s) / sum(s)),
                "wall_s": round(wall, 1),
            }
        ),
        flush=True,
    )
