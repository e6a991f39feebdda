"""A training rank up to its first step: `TrainerSetup` opens the lease, reads the data and plans
the batch, loads or builds the model, makes the optimiser, resumes (distlm.train.resume), brings
rank 0's weights to every rank through the transfer module and wraps the model in DDP.
`Trainer` (distlm.train.trainer) adds the steps, validation, checkpoints and the loop."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist

from distlm import DistlmError
from distlm.data import TokenBlocks
from distlm.data import read_tokens_meta as read_data_meta
from distlm.dist import Topology
from distlm.lease import Lease
from distlm.log import get_logger
from distlm.model import build_model, load_config_json, load_model_dir, read_meta
from distlm.settings.stage import TrainConfig
from distlm.train import checkpoint as ckpt_mod
from distlm.train import faults as faults_mod
from distlm.train import resume
from distlm.train.ddp import wrap_model
from distlm.train.metrics import Metrics
from distlm.train.optim import make_optimizer, resolve_precision, weights_of
from distlm.train.paths import TrainPaths
from distlm.train.sampler import StepLoader, StepSampler, plan_batch

# The trainer's logger: the `attempt:` line keeps the name that tests and runbooks grep for.
log = get_logger("distlm.train.trainer")


class TrainerSetup:
    """One rank's training run as set-up leaves it; see the module docstring for the phases."""

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
        self.stop_signals: list[str] = []  # the STOP_SIGNALS behind stop_requested
        self._history: dict = {}  # the metrics history of the checkpoint resumed from

    # ------------------------------------------------------------------ setup

    def setup(self) -> Self:
        if self.topo.is_main:
            # Before anything is written: a second trainer for this folder (a rerun after
            # Snakemake was killed while this job runs on, a second user) stops here, naming us.
            self.lease = Lease(self.paths.lease, what=f"training in {self.paths.out}")
            self.lease.acquire()
            log.info(
                "attempt: host %s, pid %d, SLURM job %s, SLURM restart %s, torchrun restart %s",
                socket.gethostname(),
                os.getpid(),
                os.environ.get("SLURM_JOB_ID", "-"),
                os.environ.get("SLURM_RESTART_COUNT", "0"),
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
        # test faults: None (nothing in the step loop) unless the test harness asks for one
        self.faults = faults_mod.arm(rank=self.topo.rank, world_size=self.topo.world_size)

    def _setup_optimizer(self) -> None:
        self.optimizer, self.scheduler = make_optimizer(
            self.model, self.tcfg, self.device, self.precision
        )

    def identity(self) -> dict:
        """What a checkpoint must share with this run to be resumed (checked key by key)."""
        return resume.run_identity(
            self.cfg,
            base_meta=self.base_meta,
            data_meta=self.data_meta,
            block_size=self.block_size,
            train_blocks=len(self.train_blocks),
            world_size=self.topo.world_size,
            plan=self.plan,
            precision=self.precision,
        )

    def _resume_or_start(self) -> None:
        """Find the last good checkpoint (rank 0 picks, all agree), load it, sync the weights.

        A checkpoint at step max_steps with this run's identity is finished work: it is loaded
        like any other, and `fit` writes the final folder from it without a training step.
        """
        choice = [self._choose_checkpoint() if self.topo.is_main else None]
        if self.topo.is_distributed:
            dist.broadcast_object_list(choice, src=0)
        rng_state = None
        if choice[0] is not None:
            r = resume.load_checkpoint(
                choice[0],
                identity=self.identity(),
                topo=self.topo,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                max_steps=self.tcfg.max_steps,
            )
            self.step, self._history, self.resumed_from = r.step, r.history, r.path
            rng_state = r.rng_state
        self._sync_weights()
        if rng_state is not None:
            ckpt_mod.set_rng_state(rng_state, self.device)
        else:
            # Different dropout masks per rank, reproducible from the config seed.
            torch.manual_seed(self.cfg.runtime.seed + 1000 * self.topo.rank)

    def _choose_checkpoint(self) -> tuple[str, int] | None:
        """Rank 0: open this identity's run folder, pick the checkpoint (distlm.train.resume)."""
        self.run_dir, choice = resume.choose_checkpoint(self.paths, self.tcfg, self.identity())
        return choice

    def _sync_weights(self) -> None:
        """Rank 0's weights reach every other rank through the transfer module, then are checked."""
        if not self.topo.is_distributed:
            return
        from distlm.transfer import broadcast_state_dict

        b = self.cfg.transfer
        tensors = weights_of(self.model)
        t0 = time.perf_counter()
        with torch.no_grad():
            result = broadcast_state_dict(tensors, src=0, settings=b)
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
        resume.check_replicas_agree(self.model, self.topo)

    def _wrap_ddp(self) -> None:
        # fwd: input_ids -> mean next-token loss, for evaluation (no DDP hooks)
        self.fwd, self.ddp = wrap_model(self.model, self.tcfg, self.device)
