"""The optimisation recipe: learning-rate schedule, gradient clipping, AdamW (its parameter
groups, fused kernel, schedule) and its state as a checkpoint holds it (in transformers' tensor
names, `named_optimizer_state`). The precision is the device backend's (distlm.device)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from distlm import DistlmError
from distlm.family.transformer import Transformer
from distlm.log import get_logger
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


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of all of the model's gradients together (clip_grad_norm_'s), as a tensor:
    of every rank's shards together, for a sharded model's (FSDP: a DTensor norm, made whole as
    torchtitan's clipping does)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    full = getattr(norm, "full_tensor", None)  # a DTensor's: the norm over every rank's shards
    return full() if full is not None else norm


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
        saved = _named_from_indexed(model, saved, where)
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


def _named_from_indexed(model: Transformer, saved: dict, where: str) -> dict:
    """A checkpoint's optimizer state of distlm before its own model (it trained transformers'
    modules): torch's state by index, the indices numbering transformers' parameters in its
    model's order, the matrices (decayed) first, then the rest (`param_groups`'s groups) ->
    `named_optimizer_state`'s form."""
    shapes = {k: v.shape for k, v in model.hf_tensors().items()}
    order = model.hf_order()
    decay = [n for n in order if len(shapes[n]) >= 2]
    rest = [n for n in order if len(shapes[n]) < 2]
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    if sizes != [len(decay), len(rest)]:
        raise DistlmError(
            f"{where}: optimizer state of {sizes} parameters a group, this model has "
            f"{[len(decay), len(rest)]}"
        )
    by_index = [*decay, *rest]
    groups = []
    for g, names in zip(saved["param_groups"], (decay, rest), strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    state = {by_index[int(i)]: s for i, s in saved["state"].items()}
    return {"format": OPTIMIZER_FORMAT, "state": state, "param_groups": groups}


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
