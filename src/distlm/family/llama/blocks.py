"""The Llama family's blocks (`LlamaForCausalLM`'s math, and Qwen2's, which is Llama with a bias
on q, k and v; Qwen3 adds its query/key norm): RMSNorm, rotary positions (with Llama 3.2's
`llama3` scaling, linear or yarn), grouped-query attention, a gated MLP (SiLU), a head tied to
the embeddings or not. q|k|v and gate|up are each one projection (transformers holds them
apart: distlm.family.llama.model's tensor map joins and splits them).

Rotary positions are evaluated at each token's own position, so sequences at different
positions share a micro-batch exactly (the pipeline engine's), and in float32, cast to the
hidden states' dtype, as transformers' rotary module computes them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from distlm.family.llama import LlamaArgs, RopeArgs
from distlm.family.transformer import Block, Linear, RMSNorm, activation


def inverse_frequencies(rope: RopeArgs, head_dim: int, device=None) -> tuple[torch.Tensor, float]:
    """(the rotary inverse frequencies (head_dim / 2,) in float32, the factor cos and sin are
    scaled by) of a rope type, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        old = rope.original_context
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(rope, dim, device)


def _yarn(rope: RopeArgs, dim: int, device) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_context / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp.to(device=device)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """Rotary positions: cos and sin of each position's angles. Its inverse frequencies are a
    float32 buffer that follows the model's device but never its dtype (made again whenever
    the module moves, as from the meta device), and that no state dict holds."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.rope, self.head_dim = args.rope, args.head_dim
        inv_freq, self.scaling = inverse_frequencies(args.rope, args.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        inv_freq, _ = inverse_frequencies(self.rope, self.head_dim, self.inv_freq.device)
        self.inv_freq = inv_freq  # float32, wherever the module now is
        return out

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (*pos.shape, 1, D) of positions `pos`, in `dtype`: broadcast over heads."""
        freqs = pos[..., None].float() * self.inv_freq  # (..., D / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (..., heads, D) at the positions `rot` was made for."""
    cos, sin = rot
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        D = args.head_dim
        self.split = (args.n_heads * D, args.n_kv_heads * D, args.n_kv_heads * D)
        self.qkv = Linear(args.dim, sum(self.split), bias=args.qkv_bias)  # q | k | v
        self.o = Linear(args.n_heads * D, args.dim, bias=args.o_bias)
        if args.qk_norm:  # Qwen3: each head's queries and keys RMS-normed over the head width
            self.q_norm = RMSNorm(D, args.norm_eps)
            self.k_norm = RMSNorm(D, args.norm_eps)


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate | up one projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up = Linear(args.dim, 2 * args.mlp_dim, bias=args.mlp_bias)
        self.down = Linear(args.mlp_dim, args.dim, bias=args.mlp_bias)
        self.act = activation(args.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class LlamaBlock(Block):
    """attn_norm, attention, mlp_norm, MLP (LlamaDecoderLayer; Qwen2's and Qwen3's)."""

    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__(args)
        self.qk_norm = args.qk_norm
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)  # input_layernorm
        self.attn = LlamaAttention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)  # post_attention_layernorm
        self.mlp = LlamaMLP(args)

    def project(self, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, ...]:
        D = self.head_dim
        q, k, v = self.attn.qkv(self.attn_norm(x)).split(self.attn.split, dim=-1)
        q = q.unflatten(-1, (self.n_heads, D))  # (..., nh, D)
        k = k.unflatten(-1, (self.n_kv_heads, D))  # (..., nkv, D)
        if self.qk_norm:
            q, k = self.attn.q_norm(q), self.attn.k_norm(k)
        return rotate(q, rot), rotate(k, rot), v.unflatten(-1, (self.n_kv_heads, D))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.o(attn)
        return x + self.mlp(self.mlp_norm(x))
