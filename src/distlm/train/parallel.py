"""How the training ranks hold the model (`train.parallel`). One `ParallelLayout` a run, made by
`layout_for` from the run's `Topology` and its settings, answers everything that differs between
the layouts, as torchtitan's parallelize function and its ParallelDims do; nothing else in the
stage branches on the layout (tests/test_fsdp.py checks it):

    layout = layout_for(tcfg, topo)
    layout.check_memory(args, plan)            # a rank holds what the layout gives it
    model = layout.build(folder, args)         # the model as this rank holds it
    ... AdamW over model.parameters(), the run identity, resume ...
    layout.start(model, folder, cfg, resumed=...)   # the starting weights, on every rank
    fwd, step = layout.wrap(model, tcfg)       # validation's loss module, and the step's
    with layout.micro_step(last=...): ...      # what an accumulation micro-step reduces
    norm = layout.grad_norm(model)             # over every rank's gradients (clipping's)
    layout.eval_batches(mine, most, micro)     # the forward passes a rank runs in validation
    layout.checkpoints                         # the kind of checkpoint it saves and loads
    layout.full_hf_tensors(model)              # rank 0: the whole model, transformers' names

- **ddp** (`ReplicatedLayout`): rank 0 reads the base folder and the transfer module gives every
  rank its weights; the loss module, compiled where the config asks, in DistributedDataParallel;
  gradients all-reduced on the last micro-step; whole checkpoints (rank 0's files).
- **fsdp** (`ShardedLayout`): the model is built on the meta device, `fully_shard` on each block
  and then on the root over the topology's device mesh (torchtitan's order), then allocated:
  each rank holds its shards alone and reads its own rows of the base folder's weights, so no
  rank ever holds the whole model. A `MixedPrecisionPolicy` of the training precision's
  parameters and float32 reductions. Gradients reduce-scattered per block (on every micro-step,
  or on the last: train.fsdp.reduce_every_micro_batch); clipping takes the DTensor norm; every
  rank runs as many validation passes as the rank with the most (each pass all-gathers); sharded
  checkpoints (torch.distributed.checkpoint: a run resumes on any number of ranks).

What a rank of each layout holds is the layout's rule (distlm.settings.layout_rules, torch-free),
which the workflow asks before any job and `check_memory` asks again on every rank. A third
layout (HSDP, tensor parallel) is one more class here and one more rule there.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.family import ModelArgs, family_of
from distlm.family.transformer import Transformer, check_tensors
from distlm.model import load_model_dir
from distlm.runtime.device import DeviceBackend
from distlm.runtime.dist import Topology, agree
from distlm.settings import TrainSettings
from distlm.settings.layout_rules import (
    LayoutRule,
    ModelSize,
    RankMemory,
    Replicated,
    Sharded,
    compute_bytes,
    layout_rule,
)
from distlm.train import checkpoint as ckpt
from distlm.train.checkpoint_save import save_sharded, save_whole
from distlm.train.kernels import CausalLMLoss, NextTokenLoss
from distlm.train.resume import load_sharded, load_whole
from distlm.train.setup import sync_weights
from distlm.train.state import (
    CheckpointKind,
    load_named_optimizer_state,
    named_optimizer_state,
)

if TYPE_CHECKING:
    from distlm.settings.train import BatchPlan, TrainConfig
    from distlm.train.checkpoint_writer import CheckpointWriter
    from distlm.train.state import TrainState

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
    (distlm.runtime.device), or the standard ones everywhere (`fast_kernels: false`). Both hold the
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


# ----------------------------------------------------------------------------- checkpoints


class WholeCheckpoints:
    """ddp's checkpoints: rank 0's files, the weights in transformers' names and AdamW's state by
    those names (distlm.train.checkpoint's WHOLE kind); a resume on the same number of ranks."""

    name = ckpt.WHOLE
    reshards = False  # the run identity holds the world size: a resume on the same ranks

    def __init__(self, topo: Topology) -> None:
        self.topo = topo

    def state_dict(self, model: Transformer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The weights in transformers' names (tied lm_head.weight omitted) and AdamW's state by
        those names: views of the model's and the optimizer's tensors."""
        return {"model": model.hf_tensors(), "optim": named_optimizer_state(model, optimizer)}

    def load_state_dict(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        tree: dict[str, Any],
        where: dict[str, str],
    ) -> None:
        """ "model" may be absent (ranks but 0: rank 0's weights reach them next)."""
        if "model" in tree:
            model.load_hf(tree["model"], where.get("model", "model"))
        load_named_optimizer_state(model, optimizer, tree["optim"], where.get("optim", "optim"))

    def save(self, *args, **kwargs) -> Path | None:
        """Rank 0 writes the whole checkpoint (distlm.train.checkpoint_save's `save_whole`)."""
        return save_whole(*args, **kwargs)

    def load(self, checkpoint: ckpt.Checkpoint, state: TrainState, topo: Topology) -> None:
        """Rank 0 loads the weights, every rank AdamW's state (distlm.train.resume)."""
        load_whole(checkpoint, state, topo)

    def reserve(self, writer: CheckpointWriter, state: TrainState) -> None:
        """Rank 0's host buffers for background writes, allocated while training goes on."""
        if self.topo.is_main:
            writer.reserve(state.state_dict())


class ShardedCheckpoints:
    """fsdp's checkpoints: every rank's shards of the weights and AdamW's state, in distlm's
    names (torch.distributed.checkpoint, the SHARDED kind), which reshard onto any number of
    ranks."""

    name = ckpt.SHARDED
    reshards = True

    def __init__(self, topo: Topology) -> None:
        self.topo = topo

    def state_dict(self, model: Transformer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        tree: dict[str, Any],
        where: dict[str, str],
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model, optimizer, model_state_dict=tree["model"], optim_state_dict=tree["optim"]
        )

    def save(self, *args, **kwargs) -> Path | None:
        """Every rank writes its shards (distlm.train.checkpoint_save's `save_sharded`)."""
        return save_sharded(*args, **kwargs)

    def load(self, checkpoint: ckpt.Checkpoint, state: TrainState, topo: Topology) -> None:
        """Every rank loads its shards, resharded (distlm.train.resume)."""
        load_sharded(checkpoint, state, topo)

    def reserve(self, writer: CheckpointWriter, state: TrainState) -> None:
        """Nothing: torch.distributed.checkpoint's stager keeps its own buffers."""


# ----------------------------------------------------------------------------- layouts


class ParallelLayout:
    """What every layout answers (see the module doc); `layout_for` makes the run's."""

    checkpoints: CheckpointKind

    def __init__(self, topo: Topology, rule: LayoutRule) -> None:
        self.topo = topo
        self.hw = topo.device_backend
        self.rule = rule

    @property
    def name(self) -> str:
        """train.parallel's value."""
        return self.rule.name

    # -- what a rank holds ------------------------------------------------------------------
    def memory(self, args: ModelArgs, plan: BatchPlan) -> RankMemory:
        """The bytes this rank holds at its peak, activations aside (the layout's rule)."""
        return self.rule.memory(
            ModelSize.of(args),
            self.topo.world_size,
            accumulating=plan.grad_accum > 1,
            compute_bytes=compute_bytes(self.hw.precision, self.hw.is_gpu),
        )

    def check_memory(self, args: ModelArgs, plan: BatchPlan) -> None:
        """Refuse a model whose training state this rank's device cannot hold, naming the key to
        change: the workflow's own check (distlm.settings.ranks), asked again on the node,
        where the GPU is known (under SLURM the workflow's machine may have none)."""
        budget, where = self.hw.memory(self.topo.local_world_size)
        problem = self.rule.problem(
            ModelSize.of(args),
            world=self.topo.world_size,
            budget=budget,
            where=where,
            accumulating=plan.grad_accum > 1,
            compute_bytes=compute_bytes(self.hw.precision, self.hw.is_gpu),
        )
        if problem:
            raise DistlmError(f"rank {self.topo.rank}: {problem}")

    # -- the model ----------------------------------------------------------------------------
    def build(self, folder: Path, args: ModelArgs) -> Transformer:
        """The model as this rank holds it, in float32 and train mode, before AdamW is made over
        its parameters (their values: `start`, or a resume)."""
        raise NotImplementedError

    def start(self, model: Transformer, folder: Path, cfg: TrainConfig, *, resumed: bool) -> None:
        """The weights every rank starts from, once a resume has loaded what it loads."""
        raise NotImplementedError

    def wrap(
        self, model: Transformer, tcfg: TrainSettings
    ) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the loss module, eager: what validation runs; the module the training step runs)."""
        raise NotImplementedError

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-step's forward and backward: what its gradients sync."""
        raise NotImplementedError

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step: the gradients let go (the next backward makes them)."""
        optimizer.zero_grad(set_to_none=True)

    def grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The L2 norm of all of the model's gradients together (clip_grad_norm_'s), as a
        tensor on the device, over every rank's: clipping scales by it."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def eval_batches(
        self, mine: Sequence[int], most: int, micro: int
    ) -> list[tuple[list[int], bool]]:
        """The validation passes this rank runs: (block indices, whether its loss counts), over
        its own blocks `mine` in micro-batches; `most` is the most blocks any rank has."""
        return [(list(mine[i : i + micro]), True) for i in range(0, len(mine), micro)]

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        """The whole model in transformers' names on rank 0 (every rank takes part)."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the layout holds of the model."""


class ReplicatedLayout(ParallelLayout):
    """ddp: every rank a whole copy of the model, in DistributedDataParallel."""

    def __init__(self, topo: Topology, rule: LayoutRule) -> None:
        super().__init__(topo, rule)
        self.checkpoints = WholeCheckpoints(topo)
        self._ddp: DDP | None = None

    def build(self, folder: Path, args: ModelArgs) -> Transformer:
        """Rank 0 reads the folder (verified); the others allocate theirs for `start` to fill."""
        topo = self.topo
        if topo.is_main:
            model = load_model_dir(folder, device=topo.device, dtype=torch.float32)
        else:
            model = family_of(args).build(args, device=topo.device, dtype=torch.float32)
        return model.train()

    def start(self, model: Transformer, folder: Path, cfg: TrainConfig, *, resumed: bool) -> None:
        """Rank 0's weights (the base folder's, or the checkpoint's it resumed) to every rank
        through the transfer module, then checked to agree."""
        sync_weights(model, cfg, self.topo)

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

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients zeroed in place: they are views of DDP's all-reduce buckets, which an
        accumulation micro-step (no_sync) adds into. Let go (None), the next micro-steps would
        make a second whole copy of them beside the buckets (20 bytes a parameter, not 16)."""
        optimizer.zero_grad(set_to_none=False)

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        """No gradient all-reduce but on the last micro-step."""
        assert self._ddp is not None
        return contextlib.nullcontext() if last else self._ddp.no_sync()

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        """Every rank holds it."""
        return model.hf_tensors()

    def close(self) -> None:
        """Let go of DDP (its reducer holds the process group: distlm.train.trainer.close)."""
        self._ddp = None


class ShardedLayout(ParallelLayout):
    """fsdp: each rank a shard of every block and of the root (FSDP2)."""

    rule: Sharded

    def __init__(self, topo: Topology, rule: LayoutRule) -> None:
        super().__init__(topo, rule)
        self.checkpoints = ShardedCheckpoints(topo)
        self.mesh = topo.device_mesh()  # never FSDP's default: the accelerator's
        self._model: Transformer | None = None

    def policy(self):
        """FSDP2's mixed precision: the training precision's parameters in each block's compute
        and float32 reductions; float32 throughout under fp32 (the CPU's default). The residual
        stream is then in the compute precision, where DDP's autocast keeps it in float32
        (docs/parallelism.md: both layouts train the same function to the precision's rounding,
        tests/test_fsdp.py)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = self.hw.autocast_dtype
        if dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def build(self, folder: Path, args: ModelArgs) -> Transformer:
        """The model's shapes on the meta device, each block sharded and then the root over the
        topology's mesh, then this rank's shards allocated (unset): no rank ever holds the whole
        model (torchtitan's meta-device initialisation)."""
        from torch.distributed.fsdp import fully_shard

        model = family_of(args).build(args, device="meta")
        policy = self.policy()
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        model.to_empty(device=self.topo.device)
        self._model = model
        return model.train()

    def start(self, model: Transformer, folder: Path, cfg: TrainConfig, *, resumed: bool) -> None:
        """A resumed run's shards are the checkpoint's; a new run's are read from the base
        folder, each rank its own rows (`load_rows`)."""
        if not resumed:
            self.load_rows(model, folder)

    def load_rows(self, model: Transformer, folder: Path) -> None:
        """The base folder's weights into this rank's shards: rank 0 checks the folder's sha256
        (every rank learns the outcome), then every rank reads, tensor by tensor, only the rows
        its shard holds (a transposed tensor's columns, a fused one's parts), from the mapped
        file: no rank reads a whole tensor."""
        from safetensors import safe_open

        from distlm.model.folder import verify_model_folder
        from distlm.model.layout import WEIGHTS

        error = None
        if self.topo.is_main:
            try:
                verify_model_folder(folder)
            except Exception as e:
                error = e
        agree(f"{folder}: the base model", error)
        weights = Path(folder) / WEIGHTS
        t0 = time.perf_counter()
        tmap = model.tensor_map()
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            self._check_shapes(model, f, str(weights))

            def read(name: str, span: slice, dim: int) -> torch.Tensor:
                part = f.get_slice(name)
                return part[span] if dim == 0 else part[:, span]

            for name, p in model.named_parameters():
                local = p.to_local()  # pyright: ignore[reportAttributeAccessIssue]
                if local.shape[0]:
                    first = self.topo.rank * -(-p.shape[0] // self.topo.world_size)
                    rows = tmap.rows(name, first, first + local.shape[0], read)
                    with torch.no_grad():
                        local.copy_(rows)
        log.info(
            "initial weights: each rank read its shards' rows of %s in %.2f s",
            weights,
            time.perf_counter() - t0,
        )

    @staticmethod
    def _check_shapes(model: Transformer, f, where: str) -> None:
        """The file's tensor names and shapes are the model's (a tied head's copy aside)."""
        meta = {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters()}
        expected = {h: v.shape for h, v in model.tensor_map().to_hf(meta).items()}
        tied = family_of(model.args).tied(model.args)
        found = {
            h: torch.empty(f.get_slice(h).get_shape(), device="meta")
            for h in f.keys()  # noqa: SIM118 (safe_open has keys(), no iteration)
            if h not in tied
        }
        check_tensors(found, expected, where)

    def wrap(
        self, model: Transformer, tcfg: TrainSettings
    ) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the loss module, eager: validation's; the same, compiled where the config asks:
        the step's). FSDP2's hooks do what DDP does: no wrapper."""
        module = loss_module(model, tcfg, self.hw)
        return module, self.hw.compiled(module)

    @contextlib.contextmanager
    def micro_step(self, *, last: bool) -> Iterator[None]:
        """Gradients reduce-scattered into the shards on every micro-step (a rank holds its
        shard of them alone), or, with train.fsdp.reduce_every_micro_batch false, kept whole on
        every rank until the last (4 bytes a parameter more: the rule counts them)."""
        if last or self.rule.reduce_every_micro_batch:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        model = self._model
        assert isinstance(model, FSDPModule)  # fully_shard made it one (build)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The DTensor norm of every rank's shards, made whole (as torchtitan's clipping)."""
        return super().grad_norm(model).full_tensor()  # pyright: ignore[reportAttributeAccessIssue]

    def eval_batches(
        self, mine: Sequence[int], most: int, micro: int
    ) -> list[tuple[list[int], bool]]:
        """As many passes on every rank as the rank with the most blocks runs: every forward
        pass all-gathers each block, so a rank with fewer blocks runs passes whose loss does not
        count (on its first block, or block 0), and no rank waits for one that has stopped."""
        own = super().eval_batches(mine, most, micro)
        filler = list(mine[:1]) or [0]
        return own + [(filler, False)] * (-(-most // micro) - len(own))

    def full_hf_tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        """Gathered from the shards to rank 0's host (every rank takes part; the others get
        {})."""
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


# each rule's layout (distlm.settings.layout_rules holds the rules: their arithmetic, no torch)
LAYOUTS: dict[type[LayoutRule], type[ParallelLayout]] = {
    Replicated: ReplicatedLayout,
    Sharded: ShardedLayout,
}


def layout_for(tcfg: TrainSettings, topo: Topology) -> ParallelLayout:
    """The run's layout, as `train.parallel` (and its settings) say."""
    rule = layout_rule(tcfg)
    return LAYOUTS[type(rule)](topo, rule)


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
