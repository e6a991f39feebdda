"""The Llama family's model (Llama's, and its variants Qwen2's and Qwen3's): its blocks put
together (its tensors, and their map to transformers' names, are its table: distlm.family.llama's
TENSORS)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distlm.family.llama import LlamaArgs
from distlm.family.llama.blocks import LlamaBlock, Rotary
from distlm.family.table import Cut
from distlm.family.transformer import Embedding, RMSNorm, Transformer


class LlamaEmbedding(Embedding):
    """embed_tokens: token ids -> hidden states (positions enter through rotary)."""

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().forward(ids)


class LlamaModel(Transformer):
    args: LlamaArgs
    embedding: LlamaEmbedding

    def __init__(self, args: LlamaArgs, cut: Cut | None = None) -> None:
        super().__init__(args, cut)
        self.rotary = Rotary(args)  # every stage has one: it holds no weights

    def make_embedding(self) -> nn.Module:
        return LlamaEmbedding(self.args.vocab_size, self.args.dim)

    def make_block(self, layer: int) -> LlamaBlock:
        return LlamaBlock(self.args, layer)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.dim, self.args.norm_eps)

    def positions(self, pos: torch.Tensor, dtype: torch.dtype) -> Any:
        return self.rotary(pos, dtype)
