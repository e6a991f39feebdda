"""Data-parallel training of a GPT-2-class model under torchrun, with exact resume.

    torchrun --standalone --nproc-per-node=2 workflow/scripts/train.py \\
        --config results/config/train.json --tokens results/data/tokens.h5 \\
        --tokenizer results/data/tokenizer --model results/model/base --out results/train

Phases (one method each): `setup` (data, model, initial weights from rank 0 through the transfer
module, optimiser, DDP, resume), `train_step` (micro-batches with no DDP sync but on the last,
clipping, AdamW, schedule), `evaluate`, `save_checkpoint`, `write_final`, `close`. The step loop
lives here; the phases' parts live beside it: `optim` (schedule, precision, AdamW), `ddp` (the loss
module in DDP), `resume` (run identity, checkpoint choice and loading), `outputs` (checkpoints and
the final folder), `stopping` (divergence, stop signals), `paths` (`TrainPaths`).

Learning rate: `train.lr` is the peak rate for the *global* batch (micro_batch x grad_accum x
world size blocks); it is not rescaled when the world size changes, so keep the global batch fixed
(train.global_batch_size) or rescale lr yourself (linearly for small changes).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.data import TokenBlocks
from distlm.data import read_tokens_meta as read_data_meta
from distlm.dist import Topology
from distlm.lease import Lease
from distlm.log import get_logger, progress
from distlm.model import build_model, load_config_json, load_model_dir, read_meta
from distlm.settings.stage import TrainConfig
from distlm.train import checkpoint as ckpt_mod
from distlm.train import faults as faults_mod
from distlm.train import outputs, resume
from distlm.train.ddp import wrap_model
from distlm.train.metrics import Metrics, perplexity
from distlm.train.optim import (
    fused_adamw_available,
    lr_at,
    make_optimizer,
    resolve_precision,
    weights_of,
)
from distlm.train.paths import TrainPaths
from distlm.train.profiling import StepProfiler
from distlm.train.sampler import StepLoader, StepSampler, plan_batch
from distlm.train.stopping import STOP_SIGNALS, TrainingDiverged, TrainingStopped, stop_reason

# Re-exported: callers import these from here (tests, benchmarks/train).
__all__ = [
    "TrainPaths",
    "Trainer",
    "TrainingDiverged",
    "TrainingStopped",
    "fused_adamw_available",
    "lr_at",
    "resolve_precision",
    "run_training",
]

log = get_logger(__name__)


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
        self._history: dict = {}  # the metrics history of the checkpoint resumed from

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
        self.optimizer, self.scheduler = make_optimizer(
            self.model, self.tcfg, self.device, self.precision
        )

    def identity(self) -> dict:
        """What a checkpoint must share with this run to be resumed (distlm.train.resume)."""
        return resume.run_identity(self)

    def _resume_or_start(self) -> None:
        resume.resume_or_start(self)

    def _choose_checkpoint(self) -> tuple[str, int] | None:
        return resume.choose_checkpoint(self)

    def _sync_weights(self) -> None:
        """Rank 0's weights reach every other rank through the transfer module, then are checked."""
        if not self.topo.is_distributed:
            return
        from distlm.transfer import TransferOptions, broadcast_state_dict

        b = self.cfg.transfer
        tensors = weights_of(self.model)
        opts = TransferOptions.from_config(b.model_dump())
        t0 = time.perf_counter()
        with torch.no_grad():
            result = broadcast_state_dict(tensors, src=0, options=opts)
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
        resume.check_replicas_agree(self)

    def _wrap_ddp(self) -> None:
        # fwd: input_ids -> mean next-token loss, for evaluation (no DDP hooks)
        self.fwd, self.ddp = wrap_model(self.model, self.tcfg, self.device)

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
            self.stop_requested = stop_reason(signalled, self.topo.world_size)
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

    def save_checkpoint(self) -> None:
        """All ranks call: rank 0 writes the checkpoint (distlm.train.outputs)."""
        outputs.save_checkpoint(self)

    def write_final(self, wall_s: float, *, steps_run: int | None = None) -> dict | None:
        """Rank 0 writes the final model folder (distlm.train.outputs)."""
        return outputs.write_final(self, wall_s, steps_run=steps_run)

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
            outputs.metrics_io(self.metrics.close)
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
