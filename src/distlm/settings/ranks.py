"""How many ranks a torch.distributed stage starts on a node, and which config key says so: the
one place that turns `train.nproc_per_node`, `eval.nproc_per_node` and `broadcast.receivers`
into torchrun's `--nproc-per-node`.

    r = stage_ranks(settings, "train")
    r.per_node   # 2, or "gpu": torchrun's own value, one rank per GPU of the node it runs on
    r.key        # "train.nproc_per_node": what an error about the count names

A null count follows the machine where the ranks run: one rank per GPU when the device is cuda
(or auto), one rank on the CPU. "gpu" is resolved by torchrun on each node (the SLURM launcher
resolves it first, to name the key when a node has none), so the workflow plans a GPU config on
a machine without a GPU, and a SLURM allocation's nodes decide for themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distlm import DistlmError
from distlm.runtime.machine import Machine, host_share, may_use_gpu, needs_gpu, ranks_problem
from distlm.settings.layout_rules import ModelSize, compute_bytes, layout_rule
from distlm.settings.root import Settings, known_model_args
from distlm.settings.train import plan_batch

GPU = "gpu"  # torchrun's --nproc-per-node=gpu: one rank per GPU CUDA sees on the node
TORCH_STAGES = ("broadcast", "train", "eval")


@dataclass(frozen=True)
class StageRanks:
    stage: str
    key: str  # the config key that sets the count
    per_node: int | Literal["gpu"]  # torchrun's --nproc-per-node
    on_gpu: bool  # each rank takes a GPU of its own (runtime.device cuda or auto)

    def threads(self, gpus: int) -> int:
        """The rule's `threads` (Snakemake's CPU budget for the job) on a machine with `gpus`."""
        return self.per_node if isinstance(self.per_node, int) else max(1, gpus)

    def fits(self, gpus: int) -> str | None:
        """Why these ranks cannot run on a node with `gpus` GPUs, naming the key; None if they
        can (the CPU has room for any count, and device auto runs a count on the CPU of a node
        without a GPU): distlm.runtime.machine.ranks_problem."""
        if not self.on_gpu or (gpus == 0 and self.per_node != GPU):
            return None
        count = None if self.per_node == GPU else self.per_node
        return ranks_problem(count, gpus, key=self.key, where="this machine", stage=self.stage)


def stage_ranks(s: Settings, stage: str) -> StageRanks:
    """The ranks `stage` (broadcast, train or eval) starts per node under the settings `s`."""
    on_gpu = may_use_gpu(s.runtime.device)
    if stage == "broadcast":
        key, n = "broadcast.receivers", s.broadcast.receivers
        n = None if n is None else 1 + n  # the sender and its receivers
    elif stage == "train":
        key, n = "train.nproc_per_node", s.train.nproc_per_node
    elif stage == "eval":
        key, n = "eval.nproc_per_node", s.eval.nproc_per_node
    else:
        raise KeyError(f"{stage!r} is no torch.distributed stage ({', '.join(TORCH_STAGES)})")
    per_node: int | Literal["gpu"] = n if n is not None else (GPU if on_gpu else 1)
    return StageRanks(stage, key, per_node, on_gpu)


def memory_problems(s: Settings, machine: Machine) -> list[str]:
    """What training cannot hold on this machine when every rank runs here, when the model is
    known before any job (a seeded init, a local folder): the layout's arithmetic
    (distlm.settings.layout_rules, which every rank asks again), naming the key to change."""
    args = known_model_args(s)
    r = stage_ranks(s, "train")
    if args is None:
        return []
    per_node = machine.gpus if r.per_node == GPU else r.per_node
    world = max(1, per_node) * s.train.nodes
    on_gpu = r.on_gpu and machine.gpus > 0
    if on_gpu:
        if machine.gpu_memory is None:
            return []
        budget, where = machine.gpu_memory, "each of this machine's GPUs"
    else:
        budget = host_share(per_node, machine.host_memory)
        where = "each CPU rank's share of memory"
    try:
        accumulating = plan_batch(s.train, world).grad_accum > 1
    except DistlmError:  # a batch these ranks cannot cut (each rank refuses it, naming the key)
        accumulating = True  # here: the most a rank could hold
    problem = layout_rule(s.train).problem(
        ModelSize.of(args),
        world=world,
        budget=budget,
        where=where,
        accumulating=accumulating,
        compute_bytes=compute_bytes(s.train.precision, on_gpu),
    )
    return [problem] if problem else []


def machine_problems(s: Settings, machine: Machine) -> list[str]:
    """What `machine` cannot run of `s` when every rank runs on it (the local profile): each
    names the key to change."""
    gpus = machine.gpus
    one = ranks_problem(1, gpus, key="runtime.device", where="this machine")
    if needs_gpu(s.runtime.device) and one:  # cuda on a machine without a GPU
        return [one]
    # The pipeline's stages are not here: they talk over MPI, so more stages than GPUs share them.
    counts = [p for st in TORCH_STAGES if (p := stage_ranks(s, st).fits(gpus))]
    return counts or memory_problems(s, machine)
