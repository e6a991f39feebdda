"""Training of a family's model (GPT-2, the Llama family) under torchrun, data-parallel (DDP) or
sharded (FSDP2), with exact resume.

    torchrun --standalone --nproc-per-node=2 -m distlm.entry.train \\
        --config results/config/train.json --tokens results/data/tokens.h5 \\
        --tokenizer results/data/tokenizer --model results/model/base --out results/train

Phases: construction (`Trainer(cfg, paths, topo)`, top to bottom: lease, data, the parallel
layout and its model, optimiser, run identity, resume, the starting weights on every rank, the
wrapped step, metrics), `train_step` (micro-batches synced as the layout says, clipping, AdamW,
schedule), `evaluate`, `save_checkpoint`, `write_final`, `fit` (the loop), `close`. The phases'
parts live beside this module (the package's map: distlm.train's docstring).

Learning rate: `train.lr` is the peak rate for the *global* batch (micro_batch x grad_accum x
world size blocks); it is not rescaled when the world size changes, so keep the global batch fixed
(train.global_batch_size) or rescale lr yourself (linearly for small changes).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function as phase

from distlm import DistlmError
from distlm.core.log import get_logger, progress
from distlm.model.documents import ModelMeta
from distlm.runtime import stop_latch
from distlm.runtime.dist import Topology
from distlm.settings import TrainSettings
from distlm.settings.train import TrainConfig
from distlm.train import checkpoint_save, outputs, resume, setup
from distlm.train import faults as faults_mod
from distlm.train import identity as identity_mod
from distlm.train.checkpoint_writer import CheckpointWriter
from distlm.train.metrics import Metrics, perplexity
from distlm.train.optim import (
    clip_gradients,
    fused_adamw_available,
    lr_at,
    make_optimizer,
    step_unless_nonfinite,
)
from distlm.train.parallel import layout_for, state_bytes, state_line
from distlm.train.paths import TrainPaths
from distlm.train.profiling import StepProfiler
from distlm.train.pushes import Pusher
from distlm.train.state import TrainState
from distlm.train.stopping import (
    STOP_SIGNALS,
    StopNotice,
    TrainingDiverged,
    TrainingStopped,
    stop_reason,
    stop_signals,
    write_stop_notice,
)

# Re-exported: callers import these from here (tests, benchmarks/train).
__all__ = [
    "TrainPaths",
    "Trainer",
    "TrainingDiverged",
    "TrainingStopped",
    "fused_adamw_available",
    "lr_at",
    "run_training",
    "validation_blocks",
]

log = get_logger(__name__)


def validation_blocks(tcfg: TrainSettings, available: int, world_size: int) -> int:
    """How many validation blocks the stage evaluates: the first eval_batches x micro batch x
    world size of the `available` (benchmarks/train/bench_train.py gives `Trainer` the same)."""
    return min(available, tcfg.eval_batches * tcfg.micro_batch_size * world_size)


class Trainer:
    """One rank's share of a training run; see the module docstring for the phases.

    Constructing it sets the run up to its first step; every attribute is set here. What it
    opens (the lease, the token file, the metrics files) is closed by `close`, on every exit
    path: a failure halfway through construction closes what was opened so far."""

    def __init__(self, cfg: TrainConfig, paths: TrainPaths, topo: Topology) -> None:
        t = cfg.train
        self.cfg, self.tcfg, self.paths, self.topo = cfg, t, paths, topo
        self.device = topo.device
        self.hw = topo.device_backend  # device, precision, kernels, compile (distlm.runtime.device)
        self._opened = contextlib.ExitStack()  # what close() closes, last opened first
        try:
            # rank 0's hold on the stage folder, before anything is written (None elsewhere)
            self.lease = setup.acquire_lease(paths, topo)
            if self.lease is not None:
                self._opened.callback(self.lease.release)
            self.data = setup.open_data(cfg, paths, topo)
            self._opened.callback(self.data.close)
            # how the ranks hold the model (train.parallel, distlm.train.parallel): the one
            # object that knows what differs between DDP and FSDP2
            self.layout = layout_for(t, topo)
            args, self.base_meta = setup.read_model(paths, self.data)
            # a node that cannot hold what the layout gives a rank stops here, naming the key
            # (the workflow checked it when it could: under SLURM its machine had no GPU to ask)
            self.layout.check_memory(args, self.data.plan)
            # the model as this rank holds it, before the optimizer is made over its parameters
            self.model = self.layout.build(paths.model, args)
            self.model.checkpoint_blocks(t.activation_checkpointing)
            # what the admission check counts for this rank (activations aside)
            self.predicted = self.layout.memory(args, self.data.plan)
            self.precision = self.hw.precision
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
            # test faults: None (nothing in the step loop) unless the test harness asks for one
            self.faults = faults_mod.arm(rank=topo.rank, world_size=topo.world_size)
            self.optimizer, self.scheduler = make_optimizer(
                self.model, t, self.device, self.precision
            )
            # what a checkpoint must share with this run to be resumed; names its run folder
            self.identity = identity_mod.run_identity(
                cfg,
                base=self.base_meta,
                data=self.data.meta,
                block_size=self.data.block_size,
                train_blocks=len(self.data.train),
                plan=self.data.plan,
                precision=self.precision,
            )
            # what checkpoints save and a resume loads into: the same objects as above
            self.state = TrainState(
                self.model,
                self.optimizer,
                self.scheduler,
                self.scaler,
                self.data.sampler,
                self.layout,
            )
            # rank 0: this identity's checkpoint folder (None elsewhere); the checkpoint, if any
            self.run_dir, resumed = resume.resume_or_start(
                paths, t, self.state, identity=self.identity, topo=topo
            )
            self.step = resumed.step if resumed else 0  # optimizer steps completed
            self.resumed_from = resumed.path if resumed else None
            # the weights every rank starts from: rank 0's through the transfer module (ddp), or
            # each rank's shards of the base folder unless a checkpoint's were loaded (fsdp)
            self.layout.start(self.model, paths.model, cfg, resumed=resumed is not None)
            if resumed is not None and resumed.rng_state is not None:
                self.hw.set_rng_state(resumed.rng_state)
            else:
                # Different dropout masks per rank, reproducible from the config seed (and, on a
                # sharded run resumed on other ranks, from the step it resumes at).
                torch.manual_seed(cfg.runtime.seed + 1000 * topo.rank + 7919 * self.step)
            self.hw.keep_compile_cache(paths.compile_cache)  # before the first graph compiles
            # fwd: input_ids -> mean next-token loss, eager, for validation (no DDP hooks);
            # step_module: what the training step runs (compiled where asked, in DDP for ddp)
            self.fwd, self.step_module = self.layout.wrap(self.model, t)
            self.metrics = Metrics(
                enabled=topo.is_main,
                metrics_csv=paths.metrics_csv,
                val_csv=paths.val_csv,
                tb_dir=paths.tb,
                history=resumed.history if resumed else {},
                start_step=self.step,
            )
            self._opened.callback(outputs.metrics_io, self.metrics.close)
            # rank 0's checkpoint writes, in the background where the device backend says so
            self.writer = CheckpointWriter(
                background=self.hw.background_checkpoints,
                pinned=self.hw.pin_host,
                timeout_s=cfg.transfer.timeout_s,  # how long a rank waits on another's save
            )
            self._opened.callback(self.writer.close)
            # each checkpoint into a server that follows this run, when one does (train/pushes.py)
            self.pusher = Pusher(paths.serve_endpoint, cfg.transfer, topo, self.faults)
            self._opened.callback(lambda: self.pusher.close(wait=self.stop_requested is None))
        except BaseException:
            self._opened.close()
            raise
        # the loop's state
        self._last_step_end: float | None = None  # perf_counter() when the last step ended
        self._stop_signal: int | None = None  # set by the signal handler, read at step ends
        self.stop_requested: str | None = None  # agreed by every rank at the last step end
        self.stop_signals: list[str] = []  # the STOP_SIGNALS behind stop_requested
        self.checkpoint_stalls: list[float] = []  # seconds the loop spent in each save
        # this rank's bytes of weights, gradients and optimizer state after its first step
        self.state_bytes: dict[str, int] = {}
        # the process's CPU seconds (all threads) from its launch to its first step: start-up
        self.startup_cpu_s: float | None = None
        self._next_batch: dict[int, list[torch.Tensor]] = {}  # step -> its batch, read ahead

    # ------------------------------------------------------------------ steps

    def train_step(self) -> dict:
        """Run optimizer step `self.step + 1`; return its metrics row (same on every rank)."""
        t0 = time.perf_counter()
        step = self.step
        waited = 0.0  # seconds this step waited for its rows (and the next step's) from the store
        with phase("distlm.data"):
            # read while the device ran the previous step (below), or now (the first step)
            micro = self._next_batch.pop(step, None)
            if micro is None:
                micro = self.data.loader(step)
                waited = self.data.loader.wait_s
            self._next_batch.clear()
        lr = self.optimizer.param_groups[0]["lr"]
        loss_sum = torch.zeros((), device=self.device)
        accum = len(micro)
        for i, x in enumerate(micro):
            # what an accumulation micro-step's gradients sync is the layout's (DDP: only the
            # last one's are all-reduced)
            with self.layout.micro_step(last=i == accum - 1):
                with phase("distlm.forward"), self.hw.autocast():
                    loss = self.step_module(x) / accum
                if self.faults is not None:
                    loss = self.faults.loss(step + 1, loss)  # a test's nan_at_step
                with phase("distlm.backward"):  # with DDP's gradient all-reduce
                    self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        with phase("distlm.clip"):
            self.scaler.unscale_(self.optimizer)
            clip = self.tcfg.grad_clip if self.tcfg.grad_clip > 0 else float("inf")
            gnorm = self.layout.grad_norm(self.model)
            # The mean loss over ranks travels while the optimizer steps. A NaN/inf loss on any
            # rank makes the all-reduced gradients, hence the (global) norm, non-finite on every
            # rank: the optimizer leaves that step out on every rank (step_unless_nonfinite) and
            # all ranks stop together at its end (with fp16 the scaler skips such steps and
            # training goes on). A stop request (a signal on any rank, or rank 0's lease lost)
            # travels with the loss, so every rank learns it at this step's end without a
            # collective of its own.
            # [loss, ranks that got each of STOP_SIGNALS..., rank 0's lease lost]
            loss_red = torch.zeros(2 + len(STOP_SIGNALS), device=self.device)
            loss_red[0] = loss_sum.float()
            if self._stop_signal is not None:
                loss_red[1 + STOP_SIGNALS.index(self._stop_signal)] = 1.0
            loss_red[-1] = float(self.lease is not None and self.lease.lost is not None)
            work = dist.all_reduce(loss_red, async_op=True)
            assert work is not None  # async_op=True: a Work (the stub says Optional)
            clip_gradients(self.model, clip, gnorm)
        with phase("distlm.optimizer"):
            step_unless_nonfinite(self.optimizer, self.scaler, gnorm)
            self.layout.zero_grad(self.optimizer)
            self.scheduler.step()
        if step + 1 < self.tcfg.max_steps:
            # The next step's batch is read and its copy queued while the device runs this step's
            # kernels, before the read below waits for them (nanoGPT's prefetch). A step's batch
            # is a function of the step alone: unused, it changes nothing.
            with phase("distlm.data"):
                self._next_batch[step + 1] = self.data.loader(step + 1)
                waited += self.data.loader.wait_s
        work.wait()
        # The step's one read on the host: what every rank needs at its end (the loss, the stop
        # requests) and the norm, together
        *reduced, gnorm_v = torch.cat([loss_red, gnorm.float().reshape(1)]).tolist()
        loss_v, *signalled, lost = reduced
        loss_v /= self.topo.world_size
        skipped = not math.isfinite(gnorm_v) and not self.scaler.is_enabled()  # fp16's goes on
        if skipped or not math.isfinite(loss_v):
            self._diverged(step, loss_v, gnorm_v)
        self.step = step + 1
        if lost:
            raise DistlmError(
                f"step {self.step}: stopping without a checkpoint: another trainer took over "
                f"{self.paths.lease} (this one was judged dead); see its log"
            )
        if any(signalled) and self.stop_requested is None:
            self.stop_requested = stop_reason(signalled, self.topo.world_size)
            self.stop_signals = stop_signals(signalled)
        # No device synchronize: the read above waited for the whole step, the optimizer's
        # kernels included. The step time runs from the end of the previous step, so it holds
        # everything the loop did in between: bookkeeping, and validation or a checkpoint after
        # the previous step.
        end = time.perf_counter()
        dt = end - (t0 if self._last_step_end is None else self._last_step_end)
        self._last_step_end = end
        return {
            "step": self.step,
            "loss": loss_v,
            "perplexity": perplexity(loss_v),
            "grad_norm": gnorm_v,
            "lr": lr,
            "tokens": self.step * self.data.tokens_per_step,
            "tokens_per_s": self.data.tokens_per_step / dt,
            "step_time_s": dt,
            "data_wait_s": waited,
        }

    def _diverged(self, step: int, loss: float, gnorm: float) -> None:
        raise TrainingDiverged(
            f"step {step + 1}: loss {loss}, gradient norm {gnorm}: training diverged; "
            f"the last good checkpoint is kept in {self.run_dir or self.paths.checkpoints}"
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean validation loss over the first eval_batches x micro x world blocks, all ranks.
        Each rank runs the passes the layout gives it: its own blocks, and under fsdp as many
        passes as the rank with the most (each pass all-gathers), the extra ones not counted."""
        t = self.tcfg
        val = self.data.val
        world = self.topo.world_size
        n = validation_blocks(t, len(val), world)
        mine = list(range(self.topo.rank, n, world))
        passes = self.layout.eval_batches(mine, -(-n // world), t.micro_batch_size)
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for blocks, counted in passes:
                x = torch.from_numpy(val[blocks]).to(self.device)
                with self.hw.autocast():
                    loss = self.fwd(x)
                if not counted:
                    continue
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
        val_loss = (acc[0] / acc[1]).item()
        return {
            "step": self.step,
            "val_loss": val_loss,
            "val_perplexity": perplexity(val_loss),
            "tokens": self.step * self.data.tokens_per_step,
        }

    def save_checkpoint(self, *, push: bool = True) -> None:
        """All ranks call: this step's checkpoint through the one save path
        (distlm.train.checkpoint_save.save), then rank 0 rewrites the metrics files, and with
        `push` its weights go to a server that follows the run (distlm.train.pushes). The time the
        loop spent here (the stall; a background write and the push go on after it) is logged
        and kept."""
        t0 = time.perf_counter()
        checkpoint_save.save(
            self.run_dir,
            self.step,
            self.state,
            topo=self.topo,
            identity=self.identity,
            history=self.metrics.history(),
            keep_last=self.tcfg.keep_last,
            writer=self.writer,
        )
        if self.topo.is_main:
            outputs.metrics_io(self.metrics.flush)
        if push:
            last = self.step >= self.tcfg.max_steps
            self.pusher.at_checkpoint(self.step, self.state, last=last)
        self.checkpoint_stalls.append(round(time.perf_counter() - t0, 4))
        log.info(
            "step %d: checkpoint stalled the loop %.2f s", self.step, self.checkpoint_stalls[-1]
        )

    def checkpoint_written(self) -> None:
        """All ranks: the last checkpoint is on disk (a background write finished, on every
        rank; its failure on any rank fails every rank here)."""
        self.writer.settled(f"step {self.step}: the last checkpoint")
        self.topo.barrier()

    def write_final(self, wall_s: float, *, steps_run: int | None = None) -> ModelMeta | None:
        """Rank 0 writes the final model folder (distlm.train.outputs) of the whole model (FSDP's
        shards gathered to it first: every rank takes part); all ranks wait for it."""
        meta = None
        tensors = self.layout.full_hf_tensors(self.model)
        if self.topo.is_main:
            p = self.data.plan
            run = {
                "steps": self.step,
                "tokens": self.step * self.data.tokens_per_step,
                "world_size": self.topo.world_size,
                "global_batch": p.global_batch,
                "micro_batch": p.micro_batch,
                "grad_accum": p.grad_accum,
                "block_size": self.data.block_size,
                "precision": self.precision,
                "device": self.device.type,
                "backend": self.topo.backend,
                "parallel": self.layout.name,
                "rank0_state_bytes": self.state_bytes,
                # what the admission check counted for rank 0 (activations aside), beside what
                # its device held at its peak (benchmarks/gpu/run.sh compares the two)
                "rank0_predicted_bytes": self.predicted.total,
                "rank0_peak_memory_bytes": self.hw.peak_memory(),
                # the one-time costs (the first step holds torch.compile): each save's stall of
                # the loop, and each checkpoint write's own seconds (in the background on a GPU)
                "checkpoint_stall_s": self.checkpoint_stalls,
                "checkpoint_write_s": list(self.writer.write_s),
                "startup_cpu_s": self.startup_cpu_s,
            }
            meta = outputs.write_final(
                self.paths,
                self.cfg,
                tensors=tensors,
                base_meta=self.base_meta,
                data_meta=self.data.meta,
                metrics=self.metrics,
                run=run,
                resumed_from=self.resumed_from,
                steps_run=self.step if steps_run is None else steps_run,
                wall_s=wall_s,
            )
        self.topo.barrier()
        return meta

    # ------------------------------------------------------------------ loop

    def fit(self) -> ModelMeta | None:
        t = self.tcfg
        t_start = time.perf_counter()
        start = self.step
        profiler = StepProfiler(
            t.profile,
            out_dir=self.paths.profile,
            rank=self.topo.rank,
            hw=self.hw,
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
        if stop_latch.warned() and self._stop_signal is None and start < t.max_steps:
            log.warning(
                "the time-limit warning (%s) came while this rank was starting: it stops at "
                "the first step boundary, with a checkpoint",
                stop_latch.WARNING.name,
            )
            self._stop_signal = stop_latch.WARNING
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
                            self.save_checkpoint(push=False)  # a stop does not wait on a server
                        self.checkpoint_written()  # on disk before the launcher is told
                        if self.topo.is_main and self.run_dir is not None:
                            self._tell_launcher()
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
        self.checkpoint_written()  # the last checkpoint on disk before the final folder
        self.metrics.flush()
        meta = self.write_final(time.perf_counter() - t_start, steps_run=self.step - start)
        if self.topo.is_main and self.run_dir is not None:
            identity_mod.prune_runs(self.paths.checkpoints, t.keep_runs, self.run_dir)
        return meta

    def _tell_launcher(self) -> None:
        """Rank 0, its checkpoint written: the StopNotice distlm-launch decides a requeue on."""
        assert self.run_dir is not None
        where = write_stop_notice(
            StopNotice(
                step=self.step,
                max_steps=self.tcfg.max_steps,
                signals=self.stop_signals,
                checkpoint_run=str(self.run_dir),
                slurm_job=os.environ.get("SLURM_JOB_ID"),
            )
        )
        if where is not None:
            log.info("stop notice for the launcher: %s", where)

    def _on_stop_signal(self, signum: int, _frame) -> None:
        # Only a flag: the step boundary acts on it (checkpoint, then TrainingStopped).
        self._stop_signal = signum

    def step_and_log(self, *, profiler: StepProfiler | None = None, bar=None) -> dict:
        """One optimizer step with its bookkeeping (profiler, metrics, progress bar, log line)."""
        t = self.tcfg
        first = self._last_step_end is None
        if first:
            self.startup_cpu_s = round(time.process_time(), 2)
        row = self.train_step()
        if first:
            # the host buffers of background checkpoints, allocated while training goes on
            self.layout.checkpoints.reserve(self.writer, self.state)
        if first:
            self.state_bytes = state_bytes(self.model, self.optimizer)
            log.info(
                "rank %d holds (train.parallel %s): %s",
                self.topo.rank,
                self.layout.name,
                state_line(self.model, self.optimizer),
            )
        if first:  # the one-time costs: torch.compile's first graph, the first allocations
            log.info(
                "step %d took %.2f s, the first of this process%s, after a start-up of %.2f "
                "CPU-s; later steps are the steady state",
                self.step,
                row["step_time_s"],
                f" (torch.compile included: {self.hw.compile_cache_use()})"
                if self.hw.compile
                else "",
                self.startup_cpu_s,
            )
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
        t0 = time.perf_counter()
        row = self.evaluate()
        row["seconds"] = round(time.perf_counter() - t0, 4)
        self.metrics.log_val(row)
        log.info(
            "step %d validation loss %.4f perplexity %.2f (%.2f s%s)",
            row["step"],
            row["val_loss"],
            row["val_perplexity"],
            row["seconds"],
            ", the first of this run" if len(self.metrics.val_rows) == 1 else "",
        )

    def close(self) -> None:
        """Close what construction opened (the metrics files, the token file, the lease) and let
        go of DDP; a second call does nothing.

        DDP's reducer (C++) holds the process group, and must go while `distributed()` still
        holds the group too: if the reducer's were the last reference, gloo's destructor would run
        inside the reducer's deallocation with the GIL held, joining gloo's worker threads while
        one of them waits for the GIL to free the last collective's tensors (a deadlock: a
        finished training's rank hung at exit)."""
        self._opened.close()
        if "layout" in self.__dict__:
            self.layout.close()
        self.__dict__.pop("step_module", None)


def run_training(cfg: TrainConfig, paths: TrainPaths) -> ModelMeta | None:
    """The training stage on this rank (the train stage's keys: `runtime`, `train`, `transfer`):
    process group up, train, outputs written, torn down."""
    from distlm.runtime.dist import distributed

    rt, t = cfg.runtime, cfg.train
    with distributed(
        backend=rt.backend,
        device=rt.device,
        timeout_s=rt.timeout_s,
        ranks_key="train.nproc_per_node",
        precision=t.precision,
        precision_key="train.precision",
        compile=t.compile,
    ) as topo:
        # before the model and the first step allocate (a CPU rank's heap: distlm.runtime.device)
        topo.device_backend.keep_host_memory(f"rank {topo.rank}")
        trainer = Trainer(cfg, paths, topo)
        try:
            return trainer.fit()
        finally:
            trainer.close()
