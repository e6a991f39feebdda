"""GPT-2's blocks (`GPT2LMHeadModel`'s math): learned positions added to the token embedding,
pre-LayerNorm blocks with fused q|k|v and output projections (transformers' Conv1D layers, here
linear layers), a GELU MLP, dropout after the embeddings, the attention probabilities, and each
block's two branches (in training)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distlm.family.gpt2 import GPT2Args
from distlm.family.transformer import Block, Embedding, Linear, activation


class GPT2Embedding(nn.Module):
    """wte + wpe: token ids and their positions -> hidden states."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.wte = Embedding(args.vocab_size, args.dim)
        self.wpe = Embedding(args.context, args.dim)
        self.drop = nn.Dropout(args.embd_dropout)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(pos))  # (..., C)


class GPT2Attention(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.qkv = Linear(args.dim, 3 * args.dim)  # c_attn: q | k | v
        self.proj = Linear(args.dim, args.dim)  # c_proj


class GPT2MLP(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.fc = Linear(args.dim, args.mlp_dim)  # c_fc
        self.proj = Linear(args.mlp_dim, args.dim)  # c_proj
        self.act = activation(args.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GPT2Block(Block):
    """ln_1, attention, ln_2, MLP (GPT2Block)."""

    def __init__(self, args: GPT2Args, layer: int) -> None:
        super().__init__(args)
        self.scale = args.attn_scale(layer)
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = GPT2Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = GPT2MLP(args)
        self.drop = nn.Dropout(args.resid_dropout)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        # (..., 3 C) -> (..., 3, nh, D): q, k, v as views of one projection
        return self.attn.qkv(self.ln_1(x)).unflatten(-1, (3, self.n_heads, self.head_dim))

    def project(self, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, ...]:
        return self._qkv(x).unbind(-3)  # (..., nh, D) each

    def qkv(self, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._qkv(x)
        return t[..., 0, :, :], t[..., 1:, :, :]  # views: (..., nh, D), (..., 2, nh, D)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn.proj(attn))
        return x + self.drop(self.mlp(self.ln_2(x)))
