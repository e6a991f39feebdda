"""How the training ranks hold the model (`train.parallel`): DDP, a whole copy each, or FSDP2, each
rank a shard, per block. One object a run (`Replicas`, made by `replicas_for`) answers what
differs; the trainer's loop, its checkpoints and its final folder ask it, and never branch on
the mode.

    reps = replicas_for(tcfg, hw)
    reps.prepare(model, sync)           # fsdp: the weights from rank 0, then sharded per block
    ... the optimizer over model.parameters(), resume ...
    fwd, step = reps.wrap(model, tcfg)  # the loss module (validation), what the step runs
    with reps.no_sync(): ...            # an accumulation micro-step: no gradient reduction
    reps.full_hf_tensors(model)         # rank 0: the whole model in transformers' names

- **ddp**: the loss module, compiled where the config asks, in DistributedDataParallel without
  an initial sync (the transfer module did it); checkpoints are rank 0's files.
- **fsdp**: `fully_shard` on each block, then on the root, as torchtitan applies FSDP2; on a GPU
  a `MixedPrecisionPolicy` of the training precision's parameters and float32 reductions.
  Gradients are reduce-scattered, clipping takes the DTensor norm, AdamW (fused) steps each
  rank's shard; checkpoints are sharded (`torch.distributed.checkpoint`: each rank writes its
  own, and a run resumes on any number of ranks, docs/parallelism.md).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm.device import DeviceBackend
from distlm.family.transformer import Transformer
from distlm.log import get_logger
from distlm.settings import TrainSettings
from distlm.train.kernels import CausalLMLoss, NextTokenLoss

log = get_logger(__name__)


def no_buffer_sync() -> dict:
    """DDP's keyword that turns off the buffer sync before each forward."""
    # torch >= 2.12 renamed DDP's broadcast_buffers to forward_sync_buffers (older: the former only).
    params = inspect.signature(DDP.__init__).parameters
    return (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in params
        else {"broadcast_buffers": False}
    )


def loss_module(model: Transformer, tcfg: TrainSettings, hw: DeviceBackend) -> torch.nn.Module:
    """input_ids -> mean next-token loss, with the kernels that apply: the device backend's set
    (distlm.device), or the standard ones everywhere (`fast_kernels: false`). Both hold the
    model as their only child: the model saved is the same."""
    if tcfg.fast_kernels and hw.cpu_kernels and model.linear_logits:
        module: torch.nn.Module = CausalLMLoss(model, compiled=hw.compile)
        head = "the LM head fused with the cross-entropy in cache-sized chunks"
    else:
        module = NextTokenLoss(model)
        head = "the LM head and the cross-entropy as standard operations"
    log.info(
        "loss (%s kernels%s): causal SDPA over whole blocks; %s",
        hw.kernels,
        "" if tcfg.fast_kernels else ", train.fast_kernels false",
        head,
    )
    return module


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (an FSDP2 parameter, its gradient or its optimizer state)."""
    return type(t).__name__ == "DTensor"


def local_bytes(t: torch.Tensor) -> int:
    """What this rank holds of a tensor: a DTensor's local shard, or the whole tensor."""
    local = t.to_local() if is_dtensor(t) else t  # pyright: ignore[reportAttributeAccessIssue]
    return local.numel() * local.element_size()


class Replicas:
    """DDP's way (the default): every rank a whole copy of the model."""

    name = "ddp"
    sharded = False  # checkpoints are rank 0's files, not each rank's shards

    def __init__(self, hw: DeviceBackend) -> None:
        self.hw = hw
        self._ddp: DDP | None = None

    def prepare(self, model: Transformer, sync: Callable[[], None]) -> None:
        """Before the optimizer is made: nothing for DDP (rank 0's weights, or a checkpoint's,
        reach the others after the resume: `sync_after_resume`)."""

    @property
    def sync_after_resume(self) -> bool:
        """Whether rank 0's weights go to the others after the resume (DDP), not before (FSDP)."""
        return True

    def wrap(
        self, model: Transformer, tcfg: TrainSettings
    ) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the loss module, eager and without DDP hooks: what validation runs; the same module,
        compiled where the config asks, in DDP: what the training step runs).

        Validation runs the eager module: under no_grad and eval() a compiled module would
        compile a second graph, which took as long as the first (27.5 s at GPT-2 small's shape on
        an H100, 84 s for a 30-layer Llama) for a few forward passes."""
        hw = self.hw
        module = loss_module(model, tcfg, hw)
        self._ddp = DDP(
            hw.compiled(module),
            device_ids=hw.ddp_device_ids,
            bucket_cap_mb=tcfg.ddp.bucket_cap_mb,
            gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy
            **no_buffer_sync(),  # no buffers to sync; weights already came from rank 0
            init_sync=False,  # the transfer module did (and checked) the initial broadcast
            static_graph=tcfg.ddp.static_graph,
        )
        return module, self._ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """An accumulation micro-step: no gradient all-reduce (only the last micro-step's)."""
        assert self._ddp is not None
        with self._ddp.no_sync():
            yield

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        """The whole model in transformers' names (every rank holds it)."""
        return model.hf_tensors()

    def close(self) -> None:
        """Let go of DDP (its reducer holds the process group: distlm.train.trainer.close)."""
        self._ddp = None


class ShardedReplicas(Replicas):
    """FSDP2's way (`train.parallel: fsdp`): each rank a shard of every block and of the root."""

    name = "fsdp"
    sharded = True

    def __init__(self, hw: DeviceBackend) -> None:
        super().__init__(hw)
        self._model: Transformer | None = None

    def prepare(self, model: Transformer, sync: Callable[[], None]) -> None:
        """Rank 0's weights to every rank (the transfer module), then each block sharded, then
        the root: the optimizer is made over the shards, and a resume loads into them."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        sync()
        policy = MixedPrecisionPolicy()  # the parameters' own dtype (float32)
        if self.hw.is_gpu and self.hw.autocast_dtype is not None:
            # the training precision's parameters in each block's compute, float32 reductions
            policy = MixedPrecisionPolicy(
                param_dtype=self.hw.autocast_dtype, reduce_dtype=torch.float32
            )
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self._model = model

    @property
    def sync_after_resume(self) -> bool:
        return False

    def wrap(
        self, model: Transformer, tcfg: TrainSettings
    ) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the loss module, eager: validation's; the same, compiled where the config asks:
        the step's). FSDP2's hooks do what DDP does: no wrapper."""
        module = loss_module(model, tcfg, self.hw)
        return module, self.hw.compiled(module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """An accumulation micro-step: gradients kept unreduced (only the last micro-step's are
        reduce-scattered)."""
        from torch.distributed.fsdp import FSDPModule

        model = self._model
        assert isinstance(model, FSDPModule)  # fully_shard made it one (prepare)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        """The whole model in transformers' names on rank 0's host, gathered from the shards
        (every rank takes part; the others get {})."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not full:
            return {}
        names = {n for n, _ in model.named_parameters()}  # a tied head once
        whole = {k: v for k, v in full.items() if k in names and isinstance(v, torch.Tensor)}
        return model.tensor_map().to_hf(whole)

    def close(self) -> None:
        self._model = None


def replicas_for(tcfg: TrainSettings, hw: DeviceBackend) -> Replicas:
    """The run's `Replicas`, as `train.parallel` says."""
    return ShardedReplicas(hw) if tcfg.parallel == "fsdp" else Replicas(hw)


def state_bytes(model: Transformer, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the model's state: weights, their gradients (one of each weight's
    size and dtype while a step runs, whether or not it is held now) and the optimizer's state
    (a DTensor's local shard; a tied weight once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    weights = sum(local_bytes(p) for p in params)
    return {
        "parameters": weights,
        "gradients": weights,
        "optimizer": sum(local_bytes(v) for v in opt),
    }


def state_line(model: Transformer, optimizer: torch.optim.Optimizer) -> str:
    """This rank's model state, for the log."""
    b = state_bytes(model, optimizer)
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in b.items()) + (
        f" ({sum(b.values()) / 2**20:.1f} MiB)"
    )
