"""The torch-free half of training's parallel layouts (`train.parallel`): what each layout makes a
rank hold, and the run identity's topology it keeps. The workflow asks it before any job
(distlm.settings.ranks, which has no torch) and every training rank asks it again through its
layout (distlm.train.parallel: each torch layout holds its rule), so the two checks are one.

    rule = layout_rule(settings.train)                # Replicated(), or Sharded(...)
    mem = rule.memory(ModelSize.of(args), world=4, accumulating=True, compute_bytes=2)
    mem.total                                          # bytes a rank holds at its peak
    rule.problem(size, world=4, budget=..., where="each of this machine's GPUs", ...)

The arithmetic (docs/parallelism.md, "The memory arithmetic"): every parameter has 16 bytes of
model state (float32 weights, their gradients and AdamW's two moments), whole on every rank
(`ddp`) or a 1/world shard on each (`fsdp`). A sharded rank also holds, for a while, whole
weights gathered in the compute precision: what lies outside the blocks (the embeddings, the
final norm, the head: the root's, gathered from its forward pass to the end of its backward,
with their gradients), two blocks at a time (the one computed and the next, prefetched) and one
block's gradients before they are reduce-scattered (and their float32 copy for the reduction).
Under gradient accumulation with `train.fsdp.reduce_every_micro_batch: false`, every rank keeps
the whole gradient in float32 between micro-steps: 4 bytes a parameter more. The activations come
on top (they depend on the batch and the kernels) and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from distlm.family.spec import ModelArgs
    from distlm.settings.train import BatchPlan, TrainSettings

FLOAT32 = 4
# A parameter's model state: float32 weights, their gradients and AdamW's two moments
STATE_BYTES = 4 * FLOAT32


@dataclass(frozen=True)
class ModelSize:
    """What the memory arithmetic needs of a model: its parameters (a tied head once), those of
    one of its blocks, and how many blocks it has."""

    parameters: int
    block: int
    blocks: int

    @classmethod
    def of(cls, args: ModelArgs) -> ModelSize:
        return cls(args.parameters(), args.block_parameters(), args.n_layers)

    @property
    def outside(self) -> int:
        """Parameters outside the blocks: the embeddings, the final norm, an untied head."""
        return self.parameters - self.blocks * self.block


@dataclass(frozen=True)
class RankMemory:
    """The bytes a training rank holds at its peak, by what they are."""

    state: int  # its weights, gradients and AdamW moments (float32): kept from step to step
    accumulated: int = 0  # gradients kept whole between accumulation micro-steps
    gathered: int = 0  # whole weights (and their gradients) gathered for the compute, for a while

    @property
    def total(self) -> int:
        return self.state + self.accumulated + self.gathered

    def describe(self) -> str:
        parts = [f"model state {gib(self.state)}"]
        if self.accumulated:
            parts.append(f"whole float32 gradients between micro-steps {gib(self.accumulated)}")
        if self.gathered:
            parts.append(f"weights gathered whole for the compute {gib(self.gathered)}")
        return ", ".join(parts)


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def shard(n: int, world: int) -> int:
    """A rank's share of `n` (what does not divide rounds up)."""
    return -(-n // max(1, world))


class LayoutRule:
    """One layout's arithmetic (see the module doc); `RULES` holds one of each."""

    name: ClassVar[str]  # train.parallel's value

    @classmethod
    def of(cls, t: TrainSettings) -> LayoutRule:
        """The rule with the train section's settings of this layout."""
        return cls()

    def memory(
        self, size: ModelSize, world: int, *, accumulating: bool, compute_bytes: int
    ) -> RankMemory:
        """What a rank holds at its peak, activations aside: `world` ranks, gradient accumulation
        on or off, the compute precision's bytes a parameter (2 under bf16 or fp16)."""
        raise NotImplementedError

    def holding(self, world: int) -> str:
        """How a rank holds the model state over `world` ranks, for a message."""
        raise NotImplementedError

    def identity_topology(self, plan: BatchPlan) -> dict[str, int | str]:
        """The run identity's topology (distlm.train.documents' `IdentityTopology`'s fields):
        what of the batch's cut a checkpoint of this layout must share with the run that
        resumes it."""
        raise NotImplementedError

    def problem(
        self,
        size: ModelSize,
        *,
        world: int,
        budget: int,
        where: str,
        accumulating: bool,
        compute_bytes: int,
    ) -> str | None:
        """Why a rank of `budget` bytes (`where` names it) cannot hold what this layout gives it,
        naming the key to change (another layout that would fit, or more ranks); None if it
        can."""
        kw = {"accumulating": accumulating, "compute_bytes": compute_bytes}
        mem = self.memory(size, world, **kw)
        if mem.total <= budget:
            return None
        parts = f" ({mem.describe()})" if mem.total != mem.state else ""
        head = (
            f"train.parallel: {self.name}: {size.parameters / 1e9:.2f} B parameters need "
            f"{STATE_BYTES} bytes each for training (float32 weights, gradients and AdamW's two "
            f"moments), {self.holding(world)}: {gib(mem.total)} a rank{parts}, and {where} has "
            f"{gib(budget)}"
        )
        for other in RULES.values():
            alt = other.memory(size, world, **kw)
            if other.name != self.name and alt.total <= budget:
                return (
                    f"{head}; set train.parallel: {other.name}, {other.holding(world)} "
                    f"({gib(alt.total)} a rank)"
                )
        return f"{head}: more ranks (train.nproc_per_node, train.nodes)"


class Replicated(LayoutRule):
    """`ddp`: every rank a whole copy of the model state."""

    name = "ddp"

    def memory(self, size, world, *, accumulating, compute_bytes) -> RankMemory:
        return RankMemory(state=STATE_BYTES * size.parameters)

    def holding(self, world: int) -> str:
        return "whole on every rank"

    def identity_topology(self, plan: BatchPlan) -> dict[str, int | str]:
        # the whole cut: the identity of every DDP run before FSDP (a resume on the same ranks)
        return {
            "world_size": plan.world_size,
            "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum,
            "global_batch": plan.global_batch,
        }


@dataclass(frozen=True)
class Sharded(LayoutRule):
    """`fsdp`: each rank a 1/world shard of the model state, blocks gathered whole in turn."""

    name: ClassVar[str] = "fsdp"
    # under accumulation: reduce-scatter every micro-batch's gradients (train.fsdp's key)
    reduce_every_micro_batch: bool = True

    @classmethod
    def of(cls, t: TrainSettings) -> Sharded:
        return cls(reduce_every_micro_batch=t.fsdp.reduce_every_micro_batch)

    def memory(self, size, world, *, accumulating, compute_bytes) -> RankMemory:
        c = compute_bytes
        whole_grads = accumulating and not self.reduce_every_micro_batch
        return RankMemory(
            state=STATE_BYTES * shard(size.parameters, world),
            accumulated=FLOAT32 * size.parameters if whole_grads else 0,
            # outside the blocks: weights and gradients; blocks: two gathered, one's gradients
            # and their float32 copy for the reduce-scatter
            gathered=2 * c * size.outside + (3 * c + FLOAT32) * size.block,
        )

    def holding(self, world: int) -> str:
        return f"sharded over the {world} ranks" if world > 1 else "sharded over 1 rank"

    def identity_topology(self, plan: BatchPlan) -> dict[str, int | str]:
        # the global batch alone: sharded checkpoints reshard onto any number of ranks
        return {"global_batch": plan.global_batch, "parallel": self.name}


RULES: dict[str, LayoutRule] = {r.name: r for r in (Replicated(), Sharded())}


def layout_rule(t: TrainSettings) -> LayoutRule:
    """The arithmetic of `train.parallel`, with the train section's settings of it."""
    return type(RULES[t.parallel]).of(t)


def compute_bytes(precision: str, on_gpu: bool) -> int:
    """Bytes a parameter in the compute precision: train.precision, where `auto` is bf16 (or
    fp16) on a GPU and fp32 on the CPU (distlm.runtime.device.resolve_precision)."""
    if precision == "auto":
        return 2 if on_gpu else FLOAT32
    return FLOAT32 if precision == "fp32" else 2
