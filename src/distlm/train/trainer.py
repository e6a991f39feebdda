"""Data-parallel training of a GPT-2-class model under torchrun, with exact resume.

    torchrun --standalone --nproc-per-node=2 workflow/scripts/train.py \\
        --config results/config/train.json --tokens results/data/tokens.h5 \\
        --tokenizer results/data/tokenizer --model results/model/base --out results/train

Phases (one method each): `setup` (data, model, initial weights from rank 0 through the transfer
module, optimiser, DDP, resume), `train_step` (micro-batches with no DDP sync but on the last,
clipping, AdamW, schedule), `evaluate`, `save_checkpoint`, `write_final`, `close`.

Learning rate: `train.lr` is the peak rate for the *global* batch (micro_batch x grad_accum x
world size blocks); it is not rescaled when the world size changes, so keep the global batch fixed
(train.global_batch_size) or rescale lr yourself (linearly for small changes).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm import DistlmError, __version__
from distlm.data import TokenBlocks
from distlm.data import read_tokens_meta as read_data_meta
from distlm.dist import Topology
from distlm.io import remove_leftovers
from distlm.lease import Lease
from distlm.log import get_logger, progress
from distlm.model import (
    DTYPES,
    TIED,
    build_model,
    check_state_dict,
    load_config_json,
    load_model_dir,
    read_meta,
    write_model_dir,
)
from distlm.settings import TrainSettings
from distlm.settings.stage import TrainConfig
from distlm.stages import STAGES
from distlm.train import checkpoint as ckpt_mod
from distlm.train import faults as faults_mod
from distlm.train.kernels import CausalLMLoss, ReferenceLoss, fuse_gelu
from distlm.train.metrics import Metrics, perplexity
from distlm.train.profiling import StepProfiler
from distlm.train.sampler import StepLoader, StepSampler, plan_batch

log = get_logger(__name__)


class TrainingDiverged(DistlmError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class TrainingStopped(DistlmError):
    """A signal (a SLURM time limit or preemption, scancel, a kill) asked the ranks to stop: they
    wrote a checkpoint at the step boundary and exit non-zero; a rerun resumes from it."""


# Signals that ask for a checkpoint and a clean stop at the next step boundary: SIGTERM (SLURM's
# time limit, preemption and scancel send it, torchrun forwards it) and SIGUSR1 (sent ahead of the
# time limit by `distlm-launch srun-torchrun --signal-before`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


_STAGE = STAGES["train"]


@dataclass(frozen=True)
class TrainPaths:
    """Inputs and outputs of the training stage; output names as distlm.stages declares them."""

    tokens: Path
    model: Path
    tokenizer: Path
    out: Path  # the stage folder, results/train

    @property
    def final(self) -> Path:
        return self.out / _STAGE.file("final")

    @property
    def metrics_csv(self) -> Path:
        return self.out / _STAGE.file("metrics")

    @property
    def val_csv(self) -> Path:
        return self.out / _STAGE.file("val")

    @property
    def tb(self) -> Path:
        return self.out / _STAGE.file("tb")

    @property
    def profile(self) -> Path:
        return self.out / _STAGE.file("profile")

    @property
    def checkpoints(self) -> Path:
        """The root of the run folders (one per run identity; distlm.train.checkpoint)."""
        return self.out / _STAGE.scratch["checkpoints"]

    @property
    def lease(self) -> Path:
        """One trainer per stage folder at a time (distlm.lease)."""
        return self.checkpoints / "trainer.lease.json"


# ----------------------------------------------------------------------------- pure helpers


def lr_at(step: int, tcfg: TrainSettings) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    lr, min_lr, warmup, total = tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.max_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    frac = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (lr - min_lr)


def resolve_precision(requested: str, device: torch.device) -> str:
    """fp32 / bf16 / fp16 for this device; an impossible request is an error, never a fallback."""
    if device.type == "cpu":
        if requested == "fp16":
            raise DistlmError("train.precision: fp16 needs a GPU (use fp32 or bf16 on the CPU)")
        return "fp32" if requested == "auto" else requested
    bf16_ok = torch.cuda.is_bf16_supported()
    if requested == "auto":
        return "bf16" if bf16_ok else "fp16"
    if requested == "bf16" and not bf16_ok:
        raise DistlmError(
            f"train.precision: bf16 but {torch.cuda.get_device_name(device)} lacks it; use fp16"
        )
    return requested


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights of linear layers and embeddings), not biases or norms (nanoGPT)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@functools.cache
def fused_adamw_available(device: torch.device) -> bool:
    """Whether this torch build steps AdamW(fused=True) on `device`: tried once per device on a
    one-element parameter. torch 2.13 has the fused kernel (`aten::_fused_adamw_`) for CPU, CUDA,
    MPS, XPU, HPU and MTIA (CPU since torch 2.4); a device type outside torch.optim's fused list
    is refused with a RuntimeError, one without the kernel with NotImplementedError."""
    p = torch.zeros(1, device=device, requires_grad=True)
    p.grad = torch.ones(1, device=device)
    try:
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
    except (RuntimeError, NotImplementedError) as e:
        log.info("no fused AdamW on %s (%s): the unfused AdamW steps", device, e)
        return False
    return True


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without the tied duplicate (they share storage with the parameters)."""
    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        for dup in TIED:
            sd.pop(dup, None)
    return sd


def _no_buffer_sync() -> dict:
    # torch >= 2.12 renamed DDP's broadcast_buffers to forward_sync_buffers (older: the former only).
    import inspect

    params = inspect.signature(DDP.__init__).parameters
    return (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in params
        else {"broadcast_buffers": False}
    )


# ----------------------------------------------------------------------------- trainer


class Trainer:
    """One rank's share of a DDP training run; see the module docstring for the phases."""

    def __init__(self, cfg: TrainConfig, paths: TrainPaths, topo: Topology) -> None:
        self.cfg = cfg
        self.tcfg = cfg.train
        self.paths = paths
        self.topo = topo
        self.device = topo.device
        self.step = 0  # optimizer steps completed
        self.resumed_from: str | None = None
        self._closed = False
        self._last_step_end: float | None = None  # perf_counter() when the last step ended
        self.lease: Lease | None = None  # rank 0's hold on the stage folder
        self.run_dir: Path | None = None  # rank 0: this run identity's checkpoint folder
        self._stop_signal: int | None = None  # set by the signal handler, read at step ends
        self.stop_requested: str | None = None  # agreed by every rank at the last step end

    # ------------------------------------------------------------------ setup

    def setup(self) -> Trainer:
        if self.topo.is_main:
            # Before anything is written: a second trainer for this folder (a rerun after
            # Snakemake was killed while this job runs on, a second user) stops here, naming us.
            self.lease = Lease(self.paths.lease, what=f"training in {self.paths.out}")
            self.lease.acquire()
            log.info(
                "attempt: host %s, pid %d, SLURM job %s, torchrun restart %s",
                socket.gethostname(),
                os.getpid(),
                os.environ.get("SLURM_JOB_ID", "-"),
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            )
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self._resume_or_start()
        self._wrap_ddp()
        self.metrics = Metrics(
            enabled=self.topo.is_main,
            metrics_csv=self.paths.metrics_csv,
            val_csv=self.paths.val_csv,
            tb_dir=self.paths.tb,
            history=self._history,
            start_step=self.step,
        )
        return self

    def _setup_data(self) -> None:
        t = self.tcfg
        self.train_blocks = TokenBlocks(self.paths.tokens, "train")
        self.val_blocks = TokenBlocks(self.paths.tokens, "validation")
        self.data_meta = read_data_meta(self.paths.tokens)
        if len(self.train_blocks) == 0:
            raise DistlmError(
                f"{self.paths.tokens}: the train split has no blocks: nothing to train on"
            )
        self.plan = plan_batch(t, self.topo.world_size)
        if self.topo.world_size != t.nodes * t.nproc_per_node:
            log.warning(
                "world size %d differs from train.nodes x train.nproc_per_node = %d x %d (the launcher "
                "decides; the global batch is %d)",
                self.topo.world_size,
                t.nodes,
                t.nproc_per_node,
                self.plan.global_batch,
            )
        self.sampler = StepSampler(
            len(self.train_blocks), self.plan, self.topo.rank, self.cfg.runtime.seed
        )
        self.loader = StepLoader(self.train_blocks, self.sampler, self.device)
        self.block_size = self.train_blocks.block_size
        self.tokens_per_step = self.plan.global_batch * self.block_size
        log.info(
            "data: %d train blocks of %d tokens, global batch %d blocks (%d per rank = %d micro x %d accum "
            "x %d ranks), %d tokens per step, %.2f epochs in %d steps",
            len(self.train_blocks),
            self.block_size,
            self.plan.global_batch,
            self.plan.per_rank,
            self.plan.micro_batch,
            self.plan.grad_accum,
            self.topo.world_size,
            self.tokens_per_step,
            self.sampler.epoch_of(t.max_steps),
            t.max_steps,
        )

    def _setup_model(self) -> None:
        self.model_config = load_config_json(self.paths.model)
        self.base_meta = read_meta(self.paths.model)
        if self.block_size > self.model_config.n_positions:
            raise DistlmError(
                f"{self.paths.tokens}: block size {self.block_size} is beyond the context of model "
                f"{self.paths.model} ({self.model_config.n_positions} positions)"
            )
        if self.data_meta["vocab_size"] > self.model_config.vocab_size:
            raise DistlmError(
                f"{self.paths.tokens}: vocab size {self.data_meta['vocab_size']} exceeds model "
                f"{self.paths.model}'s {self.model_config.vocab_size}"
            )
        self.precision = resolve_precision(self.tcfg.precision, self.device)
        # Rank 0 reads the weights; the others build a template that the transfer module fills.
        if self.topo.is_main:
            model = load_model_dir(self.paths.model, device=self.device, dtype=torch.float32)
        else:
            model = build_model(self.model_config).to(  # pyright: ignore[reportCallIssue]
                device=self.device, dtype=torch.float32
            )  # transformers' decorated PreTrainedModel.to loses `self` in its stub
        model.train()
        model.loss_type = "ForCausalLM"  # the shifted cross-entropy, named (silences a warning)
        self.model = model
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
            self.precision
        ]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # test faults: None (nothing in the step loop) unless a test asks for one
        self.faults = faults_mod.arm(
            nan_at_step=self.tcfg.fault.nan_at_step,
            kill_after_step=self.tcfg.fault.kill_after_step,
            rank=self.topo.rank,
            world_size=self.topo.world_size,
        )

    def _setup_optimizer(self) -> None:
        t = self.tcfg
        fused = fused_adamw_available(self.device)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
            fused=fused,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_at(s, t) / t.lr
        )
        log.info(
            "optimizer: AdamW (fused=%s), precision %s, peak lr %g for the global batch",
            fused,
            self.precision,
            t.lr,
        )

    def identity(self) -> dict:
        """What a checkpoint must share with this run to be resumed (checked key by key)."""
        t = self.tcfg
        return {
            "model": {
                "arch_digest": self.base_meta["arch_digest"],
                "base_model_sha256": self.base_meta["model_sha256"],
            },
            "data": {
                "config_digest": self.data_meta["config_digest"],
                "block_size": self.block_size,
                "train_blocks": len(self.train_blocks),
                "seed": self.cfg.runtime.seed,
            },
            "topology": {
                "world_size": self.topo.world_size,
                "micro_batch": self.plan.micro_batch,
                "grad_accum": self.plan.grad_accum,
                "global_batch": self.plan.global_batch,
            },
            "optim": {
                **{
                    k: getattr(t, k)
                    for k in (
                        "lr",
                        "min_lr",
                        "warmup_steps",
                        "max_steps",
                        "weight_decay",
                        "beta1",
                        "beta2",
                        "grad_clip",
                    )
                },
                "precision": self.precision,
            },
        }

    def _resume_or_start(self) -> None:
        """Find the last good checkpoint (rank 0 picks, all agree), load it, sync the weights.

        A checkpoint at step max_steps with this run's identity is finished work: it is loaded
        like any other, and `fit` writes the final folder from it without a training step.
        """
        self._history: dict = {}
        choice = [self._choose_checkpoint() if self.topo.is_main else None]
        if self.topo.is_distributed:
            dist.broadcast_object_list(choice, src=0)
        rng_state = None
        if choice[0] is not None:
            ck = ckpt_mod.Checkpoint(Path(choice[0][0]), choice[0][1])
            state = ckpt_mod.read_state(ck)
            ckpt_mod.check_identity(ck, state["identity"], self.identity())
            rng_state = ckpt_mod.load_rng_state(ck, self.topo.rank, self.topo.world_size)
            if self.topo.is_main:
                with torch.no_grad():
                    saved = ckpt_mod.load_weights(ck)
                    current = weights_of(self.model)
                    check_state_dict(saved, current, str(ck.path / "model.safetensors"))
                    for k, v in current.items():
                        v.copy_(saved[k])
            self.optimizer.load_state_dict(ckpt_mod.load_optimizer_state(ck, self.device))
            self.scheduler.load_state_dict(state["scheduler"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.step = state["step"]
            self._history = state["metrics"]
            self.resumed_from = str(ck.path)
            log.info("resuming from %s (step %d of %d)", ck.path, self.step, self.tcfg.max_steps)
        self._sync_weights()
        if rng_state is not None:
            ckpt_mod.set_rng_state(rng_state, self.device)
        else:
            # Different dropout masks per rank, reproducible from the config seed.
            torch.manual_seed(self.cfg.runtime.seed + 1000 * self.topo.rank)

    def _choose_checkpoint(self) -> tuple[str, int] | None:
        """Rank 0: clear leftovers of killed writes, open this identity's run folder, then pick
        its newest checkpoint that verifies (or, with none, a finished run this one extends).
        `train.resume: never` removes this identity's checkpoints first, no other's."""
        root = self.paths.checkpoints
        remove_leftovers(self.paths.out)
        ckpt_mod.clean_leftovers(root)
        ckpt_mod.migrate_legacy(root)
        identity = self.identity()
        self.run_dir = ckpt_mod.open_run(root, identity)
        ckpt_mod.clean_leftovers(self.run_dir)
        log.info("run identity %s: checkpoints in %s", self.run_dir.name, self.run_dir)
        if self.tcfg.resume == "never":
            log.warning(
                "train.resume is never: removing this run's checkpoints in %s", self.run_dir
            )
            ckpt_mod.prune(self.run_dir, 0)
            return None
        found = ckpt_mod.latest_good(self.run_dir)
        max_steps = self.tcfg.max_steps
        if found is None:
            found = ckpt_mod.extension_source(root, identity)
            if found is None:
                log.info("no checkpoint of this run yet: training from step 0")
                return None
            log.warning(
                "extending the finished run %s (step %d) to train.max_steps %d: the learning-rate "
                "schedule continues as if it had been planned for %d steps",
                found.path.parent,
                found.step,
                max_steps,
                max_steps,
            )
        elif found.step == max_steps:
            log.info(
                "%s is this run's finished work (step %d of %d): the final folder is written "
                "from it, no training step runs",
                found.path,
                found.step,
                max_steps,
            )
        return (str(found.path), found.step)

    def _sync_weights(self) -> None:
        """Rank 0's weights reach every other rank through the transfer module, then are checked."""
        if not self.topo.is_distributed:
            return
        from distlm.transfer import broadcast_state_dict

        b = self.cfg.transfer
        tensors = weights_of(self.model)
        t0 = time.perf_counter()
        with torch.no_grad():
            result = broadcast_state_dict(tensors, settings=b)
            for k, t in result.tensors.items():
                if t is not tensors[k] and t.data_ptr() != tensors[k].data_ptr():
                    tensors[k].copy_(t)
        log.info(
            "initial weights from rank 0 via the %s transport in %.2f s",
            b.transport,
            time.perf_counter() - t0,
        )
        self._check_replicas_agree()

    def _check_replicas_agree(self) -> None:
        """Every rank must start from bit-identical weights: compare a fingerprint across ranks."""
        with torch.no_grad():
            fp = torch.stack([p.detach().double().sum() for p in self.model.parameters()]).sum()
            fp = torch.stack([fp, -fp]).to(self.device)
            dist.all_reduce(fp, op=dist.ReduceOp.MAX)
        mine = (
            torch.stack([p.detach().double().sum() for p in self.model.parameters()]).sum().item()
        )
        if fp[0].item() != mine or -fp[1].item() != mine:
            raise DistlmError(
                f"rank {self.topo.rank}: weights differ from the other ranks after the initial broadcast"
            )

    def _wrap_ddp(self) -> None:
        if self.tcfg.fast_kernels:
            # Same loss and gradients (to float rounding) with less memory traffic: see
            # distlm.train.kernels. The modules swapped hold no weights; the model saved is the same.
            fused = fuse_gelu(self.model)
            module: torch.nn.Module = CausalLMLoss(self.model)
            log.info(
                "train.fast_kernels: LM head fused with the cross-entropy, %d tanh GELUs in one "
                "kernel",
                fused,
            )
        else:
            module = ReferenceLoss(self.model)
        if self.tcfg.compile:
            # an nn.Module compiles to an OptimizedModule (torch.compile's stub says Callable)
            module = cast(torch.nn.Module, torch.compile(module))
        self.fwd = module  # input_ids -> mean next-token loss, for evaluation (no DDP hooks)
        self.ddp = DDP(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.tcfg.ddp.bucket_cap_mb,
            gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy
            **_no_buffer_sync(),  # no buffers to sync; weights already came from rank 0
            init_sync=False,  # the transfer module did (and checked) the initial broadcast
            static_graph=self.tcfg.ddp.static_graph,
        )

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self) -> dict:
        """Run optimizer step `self.step + 1`; return its metrics row (same on every rank)."""
        t0 = time.perf_counter()
        step = self.step
        micro = self.loader(step)
        lr = self.optimizer.param_groups[0]["lr"]
        loss_sum = torch.zeros((), device=self.device)
        accum = len(micro)
        for i, x in enumerate(micro):
            # No gradient all-reduce on accumulation micro-steps: only the last one syncs.
            sync = self.ddp.no_sync() if i < accum - 1 else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    loss = self.ddp(x) / accum
                if self.faults is not None:
                    loss = self.faults.loss(step + 1, loss)  # train.fault.nan_at_step
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)
        clip = self.tcfg.grad_clip if self.tcfg.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        # The mean loss over ranks travels while the optimizer steps. A NaN/inf loss on any rank
        # makes the all-reduced gradients, hence the (global) norm, non-finite on every rank: all
        # ranks stop together, before the step (with fp16 the scaler skips such steps instead).
        # A stop request (a signal on any rank, or rank 0's lease lost) travels with the loss, so
        # every rank learns it at this step's end without a collective of its own.
        # [loss, ranks that got each of STOP_SIGNALS..., rank 0's lease lost]
        loss_red = torch.zeros(2 + len(STOP_SIGNALS), device=self.device)
        loss_red[0] = loss_sum.float()
        if self._stop_signal is not None:
            loss_red[1 + STOP_SIGNALS.index(self._stop_signal)] = 1.0
        loss_red[-1] = float(self.lease is not None and self.lease.lost is not None)
        work = dist.all_reduce(loss_red, async_op=True)
        assert work is not None  # async_op=True: a Work (the stub says Optional)
        gnorm_v = gnorm.item()
        if not self.scaler.is_enabled() and not math.isfinite(gnorm_v):
            work.wait()
            self._diverged(step, loss_red[0].item() / self.topo.world_size, gnorm_v)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        work.wait()
        loss_v, *signalled, lost = loss_red.tolist()
        loss_v /= self.topo.world_size
        if not math.isfinite(loss_v):
            self._diverged(step, loss_v, gnorm_v)
        self.step = step + 1
        if lost:
            raise DistlmError(
                f"step {self.step}: stopping without a checkpoint: another trainer took over "
                f"{self.paths.lease} (this one was judged dead); see its log"
            )
        if any(signalled) and self.stop_requested is None:
            self.stop_requested = ", ".join(
                f"{sig.name} on {n:.0f} of {self.topo.world_size} ranks"
                for sig, n in zip(STOP_SIGNALS, signalled, strict=True)
                if n
            )
        # No device synchronize: the .item() above already waited for forward and backward, and
        # the optimizer kernels overlap the next step's launches (counted in the next step time).
        # The step time runs from the end of the previous step, so it holds everything the loop
        # did in between: bookkeeping, and validation or a checkpoint after the previous step.
        end = time.perf_counter()
        dt = end - (t0 if self._last_step_end is None else self._last_step_end)
        self._last_step_end = end
        return {
            "step": self.step,
            "loss": loss_v,
            "perplexity": perplexity(loss_v),
            "grad_norm": gnorm_v,
            "lr": lr,
            "tokens": self.step * self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step / dt,
            "step_time_s": dt,
        }

    def _diverged(self, step: int, loss: float, gnorm: float) -> None:
        raise TrainingDiverged(
            f"step {step + 1}: loss {loss}, gradient norm {gnorm}: training diverged; "
            f"the last good checkpoint is kept in {self.run_dir or self.paths.checkpoints}"
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean validation loss over the first eval_batches x micro x world blocks, all ranks."""
        t = self.tcfg
        n = min(len(self.val_blocks), t.eval_batches * t.micro_batch_size * self.topo.world_size)
        mine = list(range(self.topo.rank, n, self.topo.world_size))
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for i in range(0, len(mine), t.micro_batch_size):
                x = torch.from_numpy(self.val_blocks[mine[i : i + t.micro_batch_size]]).to(
                    self.device
                )
                with self._autocast():
                    loss = self.fwd(x)
                count = x.shape[0] * (x.shape[1] - 1)  # predicted tokens (labels shifted by one)
                acc += torch.stack(
                    [
                        loss.double() * count,
                        torch.tensor(count, dtype=torch.float64, device=self.device),
                    ]
                )
        finally:
            self.model.train()
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        return {
            "step": self.step,
            "val_loss": val,
            "val_perplexity": perplexity(val),
            "tokens": self.step * self.tokens_per_step,
        }

    # ------------------------------------------------------------------ checkpoints / outputs

    def save_checkpoint(self) -> None:
        """All ranks call: RNG states are gathered to rank 0, which writes the checkpoint."""
        rng = ckpt_mod.rng_state(self.device)
        gathered: list[Any] | None = [None] * self.topo.world_size if self.topo.is_main else None
        dist.gather_object(rng, gathered, dst=0)
        if gathered is not None:  # rank 0
            t0 = time.perf_counter()
            state = {
                "identity": self.identity(),
                "data": {
                    "samples_consumed": self.step * self.plan.global_batch,
                    "epoch": self.sampler.epoch_of(self.step),
                    "sampler": self.sampler.state(),
                },
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                "metrics": self.metrics.history(),
                "distlm_version": __version__,
            }
            assert self.run_dir is not None  # rank 0 opened it in _choose_checkpoint
            path = ckpt_mod.save_checkpoint(
                self.run_dir,
                self.step,
                weights={k: v.detach().cpu() for k, v in weights_of(self.model).items()},
                optimizer_state=self.optimizer.state_dict(),
                rng_states=gathered,
                state=state,
                keep_last=self.tcfg.keep_last,
            )
            log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
            self._metrics_io(self.metrics.flush)
        self.topo.barrier()

    def write_final(self, wall_s: float, *, steps_run: int | None = None) -> dict | None:
        """Rank 0 writes the final model folder, in the layout of the serialized base model
        (atomically: every file fsynced, then the folder renamed into place)."""
        meta = None
        if self.topo.is_main:
            dtype_name = self.base_meta.get("dtype", "float32")
            sd = {
                k: v.detach().to("cpu", DTYPES[dtype_name]).contiguous()
                for k, v in weights_of(self.model).items()
            }
            last = self.metrics.train_rows[-1] if self.metrics.train_rows else {}
            lastval = self.metrics.val_rows[-1] if self.metrics.val_rows else {}
            training = {
                "steps": self.step,
                "tokens": self.step * self.tokens_per_step,
                "world_size": self.topo.world_size,
                "global_batch": self.plan.global_batch,
                "micro_batch": self.plan.micro_batch,
                "grad_accum": self.plan.grad_accum,
                "block_size": self.block_size,
                "precision": self.precision,
                "device": self.device.type,
                "backend": self.topo.backend,
                "train_loss": last.get("loss"),
                "val_loss": lastval.get("val_loss"),
                "val_perplexity": lastval.get("val_perplexity"),
                "resumed_from": self.resumed_from,
                "steps_this_run": self.step if steps_run is None else steps_run,
                "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                "wall_s": wall_s,
                "settings": self.tcfg.model_dump(exclude={"profile", "fault"}),
            }
            meta = write_model_dir(
                self.paths.final,
                state_dict=sd,
                config=self.model_config,
                tokenizer_dir=self.paths.tokenizer,
                meta={
                    "created_by": "train",
                    "source": {
                        "kind": "train",
                        "base_model": str(self.paths.model),
                        "base_model_sha256": self.base_meta["model_sha256"],
                    },
                    "config_digest": self.cfg.digest,
                    "data_config_digest": self.data_meta["config_digest"],
                    "dtype": dtype_name,
                    "training": training,
                },
            )
        self.topo.barrier()
        return meta

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict | None:
        t = self.tcfg
        t_start = time.perf_counter()
        start = self.step
        profiler = StepProfiler(
            t.profile,
            out_dir=self.paths.profile,
            rank=self.topo.rank,
            device=self.device,
            start_step=start,
        )
        bar = progress(
            total=t.max_steps,
            initial=start,
            enabled=self.topo.is_main,
            desc="train",
            unit="step",
        )
        last_ckpt = start if self.resumed_from else -1
        handlers = {sig: signal.signal(sig, self._on_stop_signal) for sig in STOP_SIGNALS}
        if start >= t.max_steps:
            log.info("step %d of %d reached already: the final folder only", start, t.max_steps)
        try:
            # No profiler at all when no step runs (the finished work of a killed job).
            with profiler if start < t.max_steps else contextlib.nullcontext():
                while self.step < t.max_steps:
                    self.step_and_log(profiler=profiler, bar=bar)
                    if self.step % t.eval_every == 0 or self.step == t.max_steps:
                        self._validate()
                    if self.step % t.ckpt_every == 0 or self.step == t.max_steps:
                        self.save_checkpoint()
                        last_ckpt = self.step
                    if self.stop_requested is not None and self.step < t.max_steps:
                        why = (
                            f"stopping at step {self.step} of {t.max_steps} "
                            f"({self.stop_requested}: a SLURM time limit or preemption, scancel, "
                            "or a kill)"
                        )
                        log.warning("%s: its checkpoint is written first", why)
                        if last_ckpt != self.step:
                            self.save_checkpoint()
                        raise TrainingStopped(
                            f"{why}: the checkpoint of step {self.step} is written; run the same "
                            "command again to resume from it"
                        )
                    if self.faults is not None:
                        self.faults.after_step(self.step, self.topo.rank)
        finally:
            bar.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
        if self.topo.is_main:
            profiler.write_summary(self.step - start)
        if not self.metrics.val_rows or self.metrics.val_rows[-1]["step"] != self.step:
            self._validate()
        if last_ckpt != self.step:
            self.save_checkpoint()
        self.metrics.flush()
        meta = self.write_final(time.perf_counter() - t_start, steps_run=self.step - start)
        if self.topo.is_main and self.run_dir is not None:
            ckpt_mod.prune_runs(self.paths.checkpoints, t.keep_runs, self.run_dir)
        return meta

    @staticmethod
    def _metrics_io(call) -> None:
        """Write the metrics files, which are derived: the checkpoint holds their history and the
        next start writes them again. So a failure here (Snakemake removing a stopped job's
        outputs under it, a full disk) is logged and never costs the checkpoint or hides why the
        run stopped."""
        try:
            call()
        except OSError as e:
            log.warning("metrics files not written (%s); the next start writes them again", e)

    def _on_stop_signal(self, signum: int, _frame) -> None:
        # Only a flag: the step boundary acts on it (checkpoint, then TrainingStopped).
        self._stop_signal = signum

    def step_and_log(self, *, profiler: StepProfiler | None = None, bar=None) -> dict:
        """One optimizer step with its bookkeeping (profiler, metrics, progress bar, log line)."""
        t = self.tcfg
        row = self.train_step()
        if profiler is not None:
            profiler.step()
        self.metrics.log_step(row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
        if self.step % t.log_every == 0 or self.step == t.max_steps:
            log.info(
                "step %d/%d loss %.4f ppl %.2f grad_norm %.3f lr %.3g %.0f tok/s %.1f ms",
                self.step,
                t.max_steps,
                row["loss"],
                row["perplexity"],
                row["grad_norm"],
                row["lr"],
                row["tokens_per_s"],
                1000 * row["step_time_s"],
            )
        return row

    def _validate(self) -> None:
        row = self.evaluate()
        self.metrics.log_val(row)
        log.info(
            "step %d validation loss %.4f perplexity %.2f",
            row["step"],
            row["val_loss"],
            row["val_perplexity"],
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "metrics"):
            self._metrics_io(self.metrics.close)
        for b in ("train_blocks", "val_blocks"):
            if hasattr(self, b):
                getattr(self, b).close()
        if self.lease is not None:
            self.lease.release()


def run_training(cfg: TrainConfig, paths: TrainPaths) -> dict | None:
    """The training stage on this rank (the train stage's keys: `runtime`, `train`, `transfer`):
    process group up, train, outputs written, torn down."""
    from distlm.dist import distributed

    rt = cfg.runtime
    with distributed(backend=rt.backend, device=rt.device, timeout_s=rt.timeout_s) as topo:
        trainer = Trainer(cfg, paths, topo)
        try:
            trainer.setup()
            return trainer.fit()
        finally:
            trainer.close()
