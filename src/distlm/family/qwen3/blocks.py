"""Qwen3's per-token math for a pipeline stage: the Llama family's (distlm.family.llama.blocks)
with each head's queries and keys RMS-normed (`q_norm`, `k_norm`, over the head width) before
the rotary positions, as `Qwen3Attention` does, and a head width of its own (`head_dim`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from distlm.family.llama.blocks import LlamaBlocks, check_full_attention, rms_norm, rotate_half


class Qwen3Blocks(LlamaBlocks):
    def modules(self, config) -> tuple:
        check_full_attention(config)
        from transformers.models.qwen3.modeling_qwen3 import (
            Qwen3DecoderLayer,
            Qwen3RMSNorm,
            Qwen3RotaryEmbedding,
        )

        return Qwen3DecoderLayer, Qwen3RotaryEmbedding, Qwen3RMSNorm

    def qkv(self, j: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layers[j]
        attn = layer.self_attn
        nh, nkv, D = self.n_head, self.n_kv_head, self.head_dim
        h = rms_norm(layer.input_layernorm, x)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(-1, nh, D)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(-1, nkv, D)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(-1, nkv, D)
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)  # per head, before rotary
        cos, sin = rot
        k = k * cos + rotate_half(k) * sin
        return q * cos + rotate_half(q) * sin, torch.stack((k, v), dim=1)
