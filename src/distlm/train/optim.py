"""The optimisation recipe: learning-rate schedule, gradient clipping, AdamW (its parameter
groups, fused kernel, schedule). The precision is the device backend's (distlm.runtime.device); the norm
that clipping scales by is the parallel layout's (distlm.train.parallel: over every rank's
gradients); AdamW's state as a checkpoint names it is the training state's (distlm.train.state)."""

from __future__ import annotations

import functools
import math

import torch

from distlm.core.log import get_logger
from distlm.settings import TrainSettings

log = get_logger(__name__)


def lr_at(step: int, tcfg: TrainSettings) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    lr, min_lr, warmup, total = tcfg.lr, tcfg.min_lr, tcfg.warmup_steps, tcfg.max_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    frac = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (lr - min_lr)


def clip_gradients(model: torch.nn.Module, clip: float, norm: torch.Tensor) -> None:
    """clip_grad_norm_'s scaling of the gradients by min(1, clip / (norm + 1e-6)), on the device:
    the host never reads the norm (a coefficient of 1 leaves every gradient as it was, to the
    bit). No pass at all without clipping (`clip` inf: train.grad_clip 0)."""
    if math.isfinite(clip):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip, norm, foreach=True)


def step_unless_nonfinite(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, norm: torch.Tensor
) -> None:
    """The optimizer step, or none (weights and optimizer state as they were) when the gradient
    norm is not finite, decided on the device, so the host does not wait for the backward pass
    here: with fp16 the scaler skips such a step itself; fused AdamW is given the verdict as
    GradScaler gives it (`found_inf`: its kernel leaves everything alone, and its step count goes
    back). Only an unfused AdamW (a device without the fused kernel) reads the norm on the host.
    The caller learns of a non-finite norm when it reads the step's results."""
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif optimizer.defaults.get("fused"):
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # pyright: ignore[reportAttributeAccessIssue]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # pyright: ignore[reportAttributeAccessIssue]
    elif math.isfinite(norm.item()):
        optimizer.step()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights of linear layers and embeddings), not biases or norms (nanoGPT)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@functools.cache
def fused_adamw_available(device: torch.device) -> bool:
    """Whether this torch build steps AdamW(fused=True) on `device`: tried once per device on a
    one-element parameter. torch 2.13 has the fused kernel (`aten::_fused_adamw_`) for CPU, CUDA,
    MPS, XPU, HPU and MTIA (CPU since torch 2.4); a device type outside torch.optim's fused list
    is refused with a RuntimeError, one without the kernel with NotImplementedError."""
    p = torch.zeros(1, device=device, requires_grad=True)
    p.grad = torch.ones(1, device=device)
    try:
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
    except (RuntimeError, NotImplementedError) as e:
        log.info("no fused AdamW on %s (%s): the unfused AdamW steps", device, e)
        return False
    return True


def make_optimizer(
    model: torch.nn.Module, t: TrainSettings, device: torch.device, precision: str
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused where the device has the kernel) and its warmup-cosine schedule (`lr_at`)."""
    fused = fused_adamw_available(device)
    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=1e-8,
        fused=fused,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, t) / t.lr)
    log.info(
        "optimizer: AdamW (fused=%s), precision %s, peak lr %g for the global batch",
        fused,
        precision,
        t.lr,
    )
    return optimizer, scheduler
