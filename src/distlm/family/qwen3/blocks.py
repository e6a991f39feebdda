"""Qwen3's per-token math for a pipeline stage: the Llama family's (distlm.family.llama.blocks)
with each head's queries and keys RMS-normed (`q_norm`, `k_norm`, over the head width) before
the rotary positions, as `Qwen3Attention` does, and a head width of its own (`head_dim`)."""

from __future__ import annotations

from typing import Any

import torch

from distlm.family.llama.blocks import LlamaBlocks, check_full_attention, rms_norm


class Qwen3Blocks(LlamaBlocks):
    def modules(self, config) -> tuple:
        check_full_attention(config)
        from transformers.models.qwen3.modeling_qwen3 import (
            Qwen3DecoderLayer,
            Qwen3RMSNorm,
            Qwen3RotaryEmbedding,
        )

        return Qwen3DecoderLayer, Qwen3RotaryEmbedding, Qwen3RMSNorm

    def qk_norm(self, attn: Any, q: torch.Tensor, k: torch.Tensor):
        """Each head's queries and keys RMS-normed over the head width (`q_norm`, `k_norm`)."""
        return rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
