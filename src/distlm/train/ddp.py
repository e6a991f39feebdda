"""The model as DDP trains it: the loss module (the device's kernels), compiled where the config
asks, wrapped in DistributedDataParallel without an initial sync (the transfer module did it)."""

from __future__ import annotations

import inspect

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
    if tcfg.fast_kernels and hw.kernels == "cpu" and model.linear_logits:
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


def wrap_model(
    model: Transformer, tcfg: TrainSettings, hw: DeviceBackend
) -> tuple[torch.nn.Module, DDP]:
    """(the loss module, eager and without DDP hooks: what validation runs; the same module,
    compiled where the config asks, in DDP: what the training step runs).

    Validation runs the eager module: under no_grad and eval() a compiled module would compile
    a second graph, which took as long as the first (27.5 s at GPT-2 small's shape on an H100,
    84 s for a 30-layer Llama) for a few forward passes."""
    module = loss_module(model, tcfg, hw)
    ddp = DDP(
        hw.compiled(module),
        device_ids=hw.ddp_device_ids,
        bucket_cap_mb=tcfg.ddp.bucket_cap_mb,
        gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy
        **no_buffer_sync(),  # no buffers to sync; weights already came from rank 0
        init_sync=False,  # the transfer module did (and checked) the initial broadcast
        static_graph=tcfg.ddp.static_graph,
    )
    return module, ddp
