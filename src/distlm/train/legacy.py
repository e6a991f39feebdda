"""Checkpoints of distlm before its own model (releases up to 2026-11-2x trained transformers'
modules): their optimizer.pt numbered transformers' parameters in its model's order. The one
converter of that form, outside the families: a family added since has no such checkpoints, and
none declares an order for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from distlm import DistlmError
from distlm.family import family_of

if TYPE_CHECKING:
    from distlm.family.transformer import Transformer


def transformers_order(model: Transformer) -> list[str]:
    """transformers' tensors of `model` in transformers' model's order (its
    `named_parameters()`): that model of the family, built on the meta device (no memory, no
    weights) from `model`'s config keys with every optional bias on, read for its order; the
    tensors `model` holds, in it."""
    args = model.args
    keys = {k: v for k, v in args.signature().items() if k != "model_type"}
    config = family_of(args).config_class(**keys, attention_bias=True, mlp_bias=True)
    with torch.device("meta"):
        theirs = family_of(args).hf_model_class(config)
    have = set(model.hf_tensors())
    return [n for n, _ in theirs.named_parameters() if n in have]


def named_from_indexed(model: Transformer, saved: dict, fmt: str, where: str) -> dict:
    """A checkpoint's optimizer state of distlm before its own model (it trained transformers'
    modules): torch's state by index, the indices numbering transformers' parameters in its
    model's order, the matrices (decayed) first, then the rest (`param_groups`'s groups) ->
    `named_optimizer_state`'s form."""
    shapes = {k: v.shape for k, v in model.hf_tensors().items()}
    order = transformers_order(model)
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
    return {"format": fmt, "state": state, "param_groups": groups}
