"""What a training checkpoint saves and a resume loads, in one object: `TrainState`, the model,
AdamW, the schedule, the gradient scaler and the data position of a run, and how the ranks hold
the model (the `Replicas` that made it: whether checkpoints are whole files or each rank's
shards). distlm.train.checkpoint's `save` and distlm.train.resume's loads take it whole.

    state = TrainState(model, optimizer, scheduler, scaler, sampler, replicas)
    tree = state.state_dict()        # the tensors: {"model": ..., "optim": ...}
    state.load_state_dict(tree)      # back into the model and AdamW (in place)
    doc = state.checkpoint_state(step, identity=identity, history=history)   # state.json
    state.load_checkpoint_state(doc)  # the schedule and the scaler

It follows torch.distributed.checkpoint's `Stateful` protocol (`state_dict` /
`load_state_dict`), as torchtitan's `ModelWrapper` and `TrainState` do, over the tensors a
checkpoint holds: a whole checkpoint's model.safetensors and optimizer.pt (transformers' names),
or a sharded one's `shards/` (distlm's names, each rank's DTensor shards), one tree either way.
The rest (the step's data position, the schedule, the scaler) is state.json's `CheckpointState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distlm import __version__
from distlm.documents import CheckpointState, RunIdentity
from distlm.train.optim import load_named_optimizer_state, named_optimizer_state

if TYPE_CHECKING:
    from distlm.family.transformer import Transformer
    from distlm.train.parallel import Replicas
    from distlm.train.step_sampler import StepSampler


@dataclass(frozen=True, eq=False)
class TrainState:
    """One rank's training state: what its checkpoints hold and a resume loads into (in place)."""

    model: Transformer  # FSDP: this rank's shards (fully_shard'ed by `replicas`)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: StepSampler  # the data position: a function of the step and the sampler's stream
    replicas: Replicas  # how the ranks hold the model (train.parallel)

    @property
    def sharded(self) -> bool:
        """Whether checkpoints hold each rank's shards (FSDP), not rank 0's whole files."""
        return self.replicas.sharded

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's tensors, {"model": ..., "optim": ...}: whole, the weights in
        transformers' names (tied lm_head.weight omitted) and AdamW's state by those names
        (views of the model's and the optimizer's tensors: model.safetensors and optimizer.pt);
        sharded, torch.distributed.checkpoint's state dicts of this rank's shards (`shards/`)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd}
        return {
            "model": self.model.hf_tensors(),
            "optim": named_optimizer_state(self.model, self.optimizer),
        }

    def load_state_dict(
        self, state_dict: dict[str, Any], *, where: dict[str, str] | None = None
    ) -> None:
        """`state_dict`'s tensors (as `state_dict` gives them) into the model and AdamW. Whole,
        "model" may be absent (ranks but 0: rank 0's weights reach them next); `where` names
        each part's file for errors ({"model": ..., "optim": ...})."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
            )
            return
        where = where or {}
        if "model" in state_dict:
            self.model.load_hf(state_dict["model"], where.get("model", "model"))
        load_named_optimizer_state(
            self.model, self.optimizer, state_dict["optim"], where.get("optim", "optim")
        )

    def checkpoint_state(
        self, step: int, *, identity: RunIdentity, history: dict
    ) -> CheckpointState:
        """state.json of step `step`'s checkpoint: the data position, the schedule, the scaler
        (fp16's; empty otherwise), the metric `history` and the run `identity`."""
        sampler = self.sampler
        return CheckpointState(
            identity=identity,
            data={
                "samples_consumed": step * sampler.plan.global_batch,
                "epoch": sampler.epoch_of(step),
                "sampler": sampler.state(),
            },
            scheduler=self.scheduler.state_dict(),
            scaler=self.scaler.state_dict() if self.scaler.is_enabled() else {},
            metrics=history,
            distlm_version=__version__,
            step=step,
        )

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        """A checkpoint's schedule and scaler (the data position follows from its step)."""
        self.scheduler.load_state_dict(state.scheduler)
        if state.scaler:
            self.scaler.load_state_dict(state.scaler)
