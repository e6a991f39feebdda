"""What a pipeline stage asks of a model family: one stage's weights and its per-token math.

The inference engine (`distlm.inference.engine.pipeline_stage`) owns everything that is not per token: the
lanes, the KV cache, the packed micro-batch and the attention call (SDPA). For each decoder layer
it asks the family's blocks for the new tokens' queries, keys and values, attends, and hands the
attention output back:

    x = blocks.embed(ids, pos)               # stage 0: token ids (N,) -> (N, C)
    rot = blocks.positions(pos)              # once per micro-batch (rotary cos/sin, or None)
    for j in range(blocks.n_layers):
        q, kv = blocks.qkv(j, x, rot)        # (N, n_head, D), (N, 2, n_kv_head, D)
        a = attention(q, kv, scale=blocks.scales[j])     # the engine's: (N, n_head * D)
        x = blocks.finish(j, x, a)           # output projection, residual, MLP -> (N, C)
    logits = blocks.head(x)                  # last stage: final norm + LM head

N is the micro-batch's new tokens packed along one axis (several sequences at their own
positions); C the hidden size, D the head size. Every method is a handful of tensor operations on
the packed tensor, with no Python work per token: a decode step's cost must not grow with Python.
The weights are the family's own transformers modules, so the state-dict names (`local_name` of a
checkpoint tensor) and shapes are the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class StageBlocks(nn.Module):
    """One pipeline stage of a model family: embeddings (first), decoder layers [start, end), final
    norm and LM head (last). The KV cache of layer j is (lanes, 2, n_kv_head, T, head_dim): keys,
    then values, written together."""

    n_head: int  # query heads
    n_kv_head: int  # key/value heads (fewer than n_head: grouped-query attention)
    head_dim: int
    n_layers: int  # end - start
    context: int  # positions the model was built for (the cache never grows past it)
    scales: list[float]  # SDPA scale of each local layer
    # the family's logits hook (Family.logits: LM head, hidden -> logits), set by Family.stage_blocks
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]

    def __init__(self, *, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.first, self.last = first, last
        self.n_layers = end - start

    def local_name(self, name: str) -> str:
        """A checkpoint tensor's name (`transformer.h.7.attn.c_attn.weight`) as this module's
        parameter (`h.2.attn.c_attn.weight` on a stage starting at layer 5)."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token ids (N,) at positions `pos` (N,) -> hidden states (N, C) (first stage)."""
        raise NotImplementedError

    def positions(self, pos: torch.Tensor) -> Any:
        """What `qkv` needs of the new tokens' positions (N,), computed once per micro-batch and
        shared by every layer; None for a family whose attention takes no positions."""
        return None

    def qkv(self, j: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Local layer j's queries (N, n_head, D) and keys and values (N, 2, n_kv_head, D: keys
        then values, one write into the cache) of hidden states (N, C); `rot` is
        `positions(pos)` (rotary families rotate q and k here)."""
        raise NotImplementedError

    def finish(self, j: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Local layer j after attention: `x` the layer's input (N, C), `attn` the attention
        output (N, n_head * D) -> the layer's output (N, C)."""
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, then the family's logits hook: hidden states (M, C) -> logits (M, V) (last
        stage)."""
        raise NotImplementedError
