"""What a training checkpoint saves and a resume loads, in one object: `TrainState`, the model,
AdamW, the schedule, the gradient scaler and the data position of a run, and how the ranks hold
the model (the parallel layout that made it, distlm.train.parallel, whose `checkpoints` say what
the tensors of its kind of checkpoint are). distlm.train.checkpoint_save's `save` and
distlm.train.resume's loads take it whole. Beside it, AdamW's state as a whole checkpoint names
it (`named_optimizer_state`: each parameter's state under transformers' names and layouts).

    state = TrainState(model, optimizer, scheduler, scaler, sampler, layout)
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from distlm import DistlmError, __version__
from distlm.train.documents import CheckpointState, RunIdentity

if TYPE_CHECKING:
    from distlm.family.transformer import Transformer
    from distlm.runtime.dist import Topology
    from distlm.train.checkpoint import Checkpoint
    from distlm.train.checkpoint_writer import CheckpointWriter
    from distlm.train.step_sampler import StepSampler


class CheckpointKind(Protocol):
    """The kind of checkpoint a parallel layout saves and loads (distlm.train.parallel's
    `WholeCheckpoints` or `ShardedCheckpoints`): what the training state asks of it."""

    name: str  # distlm.train.checkpoint's WHOLE or SHARDED
    reshards: bool  # loads onto another number of ranks

    def state_dict(self, model: Transformer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The tensors a checkpoint of this kind holds: {"model": ..., "optim": ...}."""
        ...

    def load_state_dict(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        tree: dict[str, Any],
        where: dict[str, str],
    ) -> None: ...

    def save(
        self,
        run_dir: Path | None,
        step: int,
        state: TrainState,
        *,
        topo: Topology,
        rng: list | None,
        doc: CheckpointState | None,
        keep_last: int,
        writer: CheckpointWriter,
    ) -> Path | None: ...

    def load(self, checkpoint: Checkpoint, state: TrainState, topo: Topology) -> None: ...

    def reserve(self, writer: CheckpointWriter, state: TrainState) -> None: ...


class Layout(Protocol):
    """What the training state asks of the run's parallel layout (distlm.train.parallel's
    `ParallelLayout`)."""

    @property
    def checkpoints(self) -> CheckpointKind: ...

    @property
    def name(self) -> str: ...

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True, eq=False)
class TrainState:
    """One rank's training state: what its checkpoints hold and a resume loads into (in place)."""

    model: Transformer  # FSDP: this rank's shards (fully_shard'ed by `layout`)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: StepSampler  # the data position: a function of the step and the sampler's stream
    layout: Layout  # how the ranks hold the model (train.parallel: distlm.train.parallel)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's tensors, {"model": ..., "optim": ...}, as the layout's kind of
        checkpoint holds them (its `checkpoints.state_dict`): whole, the weights in
        transformers' names and AdamW's state by those names; sharded,
        torch.distributed.checkpoint's state dicts of this rank's shards."""
        return self.layout.checkpoints.state_dict(self.model, self.optimizer)

    def load_state_dict(
        self, state_dict: dict[str, Any], *, where: dict[str, str] | None = None
    ) -> None:
        """`state_dict`'s tensors (as `state_dict` gives them) into the model and AdamW, in
        place; `where` names each part's file for errors ({"model": ..., "optim": ...})."""
        self.layout.checkpoints.load_state_dict(self.model, self.optimizer, state_dict, where or {})

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


# ----------------------------------------------------------------------------- AdamW's names


# optimizer.pt's format since distlm trains its own model: the state of each transformers tensor
OPTIMIZER_FORMAT = "distlm-optimizer/2"


def named_optimizer_state(model: Transformer, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as a checkpoint's optimizer.pt holds it: each parameter's state
    (AdamW's step and moments) under transformers' names and layouts, as views (a fused
    projection's moments split as its weight is), and the parameter groups' settings with their
    tensors' names. A checkpoint so holds nothing of distlm's internal layout."""
    names = {id(p): n for n, p in model.named_parameters()}
    tmap = model.tensor_map()
    saved = optimizer.state_dict()  # state by index, over the groups' parameters in order
    state: dict[str, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        hf_names = []
        for p in group["params"]:
            name = names[id(p)]
            parts = tmap.hf_names(name)
            hf_names += parts
            for k, v in saved["state"].get(index, {}).items():
                split = (
                    tmap.split(name, v)
                    if isinstance(v, torch.Tensor) and v.shape == p.shape
                    else dict.fromkeys(parts, v)  # a scalar (AdamW's step): each part's
                )
                for hf, part in split.items():
                    state.setdefault(hf, {})[k] = part
            index += 1
        groups.append(
            {**{k: v for k, v in saved_group.items() if k != "params"}, "params": hf_names}
        )
    return {"format": OPTIMIZER_FORMAT, "state": state, "param_groups": groups}


def load_named_optimizer_state(
    model: Transformer, optimizer: torch.optim.Optimizer, saved: dict, where: str
) -> None:
    """Load an optimizer.pt (`named_optimizer_state`'s, or a checkpoint's of distlm before its
    own model: torch's state by index over transformers' parameters) into `optimizer`."""
    if saved.get("format") != OPTIMIZER_FORMAT:
        from distlm.train.legacy import named_from_indexed

        saved = named_from_indexed(model, saved, OPTIMIZER_FORMAT, where)
    tmap = model.tensor_map()
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise DistlmError(
            f"{where}: {len(saved['param_groups'])} parameter groups, this run has "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            parts = tmap.hf_names(name)
            missing = [h for h in parts if h not in saved_group["params"]]
            if missing:
                raise DistlmError(f"{where}: no optimizer state of tensor {missing[0]!r}")
            per = [saved["state"].get(h, {}) for h in parts]
            if any(per):
                joined = {}
                for k, v in per[0].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        joined[k] = _laid_out_as(p, tmap.join(name, [s[k] for s in per]))
                    else:
                        joined[k] = v
                state[index] = joined
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _laid_out_as(param: torch.Tensor, moment: torch.Tensor) -> torch.Tensor:
    """`moment` (a state tensor joined from a checkpoint's: a transposed one is a view) with
    `param`'s strides: CUDA's fused AdamW refuses a moment laid out unlike its parameter
    ("must have same dtype, device, and layout"), and `Optimizer.load_state_dict` keeps a tensor's
    strides when it needs no copy to the parameter's device."""
    if moment.stride() == param.stride():
        return moment
    return torch.empty_like(param, dtype=moment.dtype, device=moment.device).copy_(moment)
