"""GPT-2's model: its blocks put together (its tensors, and their map to transformers' names, are
its table: distlm.family.gpt2's TENSORS)."""

from __future__ import annotations

from torch import nn

from distlm.family.gpt2 import GPT2Args
from distlm.family.gpt2.blocks import GPT2Block, GPT2Embedding
from distlm.family.transformer import Transformer


class GPT2Model(Transformer):
    args: GPT2Args
    embedding: GPT2Embedding

    def make_embedding(self) -> nn.Module:
        return GPT2Embedding(self.args)

    def make_block(self, layer: int) -> GPT2Block:
        return GPT2Block(self.args, layer)

    def make_norm(self) -> nn.Module:
        return nn.LayerNorm(self.args.dim, eps=self.args.norm_eps)
