"""The model as DDP trains it: the loss module (fused kernels or transformers' own), optionally
compiled, wrapped in DistributedDataParallel without an initial sync (the transfer module did it)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, cast

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm.log import get_logger
from distlm.model import family_of
from distlm.settings import TrainSettings
from distlm.train.kernels import CausalLMLoss, ReferenceLoss, fuse_gelu

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


def wrap_model(
    model: PreTrainedModel, tcfg: TrainSettings, device: torch.device
) -> tuple[torch.nn.Module, DDP]:
    """(input_ids -> mean next-token loss without DDP hooks, for evaluation; the same in DDP)."""
    kernels = family_of(model.config).kernels
    if tcfg.fast_kernels and kernels:
        # Same loss and gradients (to float rounding) with less memory traffic: see
        # distlm.train.kernels. The modules swapped hold no weights; the model saved is the same.
        # Which apply is the family's: GPT-2 both, the Llama family the linear cross-entropy.
        fused = fuse_gelu(model) if "gelu" in kernels else 0
        module: torch.nn.Module = CausalLMLoss(model)
        log.info(
            "train.fast_kernels: LM head fused with the cross-entropy, %d tanh GELUs in one kernel",
            fused,
        )
    else:
        module = ReferenceLoss(model)
    if tcfg.compile:
        # an nn.Module compiles to an OptimizedModule (torch.compile's stub says Callable)
        module = cast(torch.nn.Module, torch.compile(module))
    ddp = DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=tcfg.ddp.bucket_cap_mb,
        gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy
        **no_buffer_sync(),  # no buffers to sync; weights already came from rank 0
        init_sync=False,  # the transfer module did (and checked) the initial broadcast
        static_graph=tcfg.ddp.static_graph,
    )
    return module, ddp
