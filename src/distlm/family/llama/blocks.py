"""The Llama family's per-token math for a pipeline stage (`LlamaForCausalLM`, and Qwen2, which is
Llama with a bias on q, k and v; Qwen3 builds on it in its own folder): RMSNorm, rotary positions,
grouped-query attention, a gated SiLU MLP, a head tied to the embeddings or not.

The weights are transformers' own decoder layers (`LlamaDecoderLayer`, `Qwen2DecoderLayer`), so
the checkpoint's names, shapes and biases hold as they are; their math runs here through the
functional operations their forward calls. Rotary positions come from the family's own rotary
module (`LlamaRotaryEmbedding`, which applies `rope_parameters` such as Llama 3.2's `llama3`
scaling), evaluated at each new token's own position: sequences at different positions share a
micro-batch exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distlm import DistlmError
from distlm.family.blocks import StageBlocks

# rope types whose frequencies depend on the sequence's length (transformers' dynamic_rope_update):
# sequences of different lengths share a micro-batch, so one set of frequencies cannot serve them
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class LlamaBlocks(StageBlocks):
    """embed_tokens (first), decoder layers [start, end), norm + lm_head (last) of a Llama config;
    a family built on it names its own modules (`modules`)."""

    def __init__(
        self, config, start: int, end: int, *, first: bool, last: bool, kernels: str = "standard"
    ) -> None:
        # kernels: the device's set (distlm.device); the Llama family's math has no CPU-only form
        super().__init__(start=start, end=end, first=first, last=last)
        check_rope(config)
        layer_cls, rotary_cls, norm_cls = self.modules(config)
        config._attn_implementation = "sdpa"
        C = config.hidden_size
        if first:
            self.embed_tokens = nn.Embedding(config.vocab_size, C)
        self.layers = nn.ModuleList(layer_cls(config, layer_idx=i) for i in range(start, end))
        self._layers: list[Any] = list(self.layers)  # the same modules, indexed without a call
        if last:
            self.norm = norm_cls(C, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        # the rotary module holds no weights (its inv_freq buffer is not persistent): every stage
        # has one, built from the config as transformers builds it
        self.rotary_emb = rotary_cls(config)
        self.n_head = config.num_attention_heads
        self.n_kv_head = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or C // self.n_head
        self.context = config.max_position_embeddings
        self.scales = [self.head_dim**-0.5] * self.n_layers  # LlamaAttention.scaling

    def local_name(self, name: str) -> str:
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            return f"layers.{int(layer) - self.start}.{rest}"
        if name.startswith("model."):
            return name[len("model.") :]
        return name

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # (N, C); positions enter through rotary

    def positions(self, pos: torch.Tensor) -> Any:
        """cos, sin (N, 1, D) of each new token's position, in the weights' dtype."""
        w = self._layers[0].self_attn.q_proj.weight
        probe = torch.empty(0, dtype=w.dtype, device=w.device)  # what the rotary module reads
        cos, sin = self.rotary_emb(probe, pos.unsqueeze(0))  # (1, N, D) each
        return cos.transpose(0, 1), sin.transpose(0, 1)  # (N, 1, D): broadcast over heads

    def qkv(self, j: int, x: torch.Tensor, rot: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layers[j]
        attn = layer.self_attn
        nh, nkv, D = self.n_head, self.n_kv_head, self.head_dim
        h = rms_norm(layer.input_layernorm, x)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(-1, nh, D)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(-1, nkv, D)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(-1, nkv, D)
        q, k = self.qk_norm(attn, q, k)
        cos, sin = rot
        k = k * cos + rotate_half(k) * sin
        return q * cos + rotate_half(q) * sin, torch.stack((k, v), dim=1)

    def qk_norm(self, attn: Any, q: torch.Tensor, k: torch.Tensor):
        """Queries (N, n_head, D) and keys (N, n_kv_head, D) before the rotary positions: as they
        are (a family that norms them, Qwen3, says how)."""
        return q, k

    def finish(self, j: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        layer = self._layers[j]
        o = layer.self_attn.o_proj
        # x + o_proj(attn), act(gate) * up and x + down_proj(...) written into the fresh tensors
        # (addition and multiplication commute: the same bits, no allocation each)
        x = F.linear(attn, o.weight, o.bias).add_(x)
        mlp = layer.mlp
        h = rms_norm(layer.post_attention_layernorm, x)
        gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        return F.linear(mlp.act_fn(gate).mul_(up), mlp.down_proj.weight, mlp.down_proj.bias).add_(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.lm_head, rms_norm(self.norm, x))

    def modules(self, config) -> tuple:
        """transformers' (decoder layer, rotary embedding, RMSNorm) classes of this family."""
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        return LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaRMSNorm


class Qwen2Blocks(LlamaBlocks):
    """Qwen2's stage: Llama's math with a bias on q, k and v (its decoder layer holds them)."""

    def modules(self, config) -> tuple:
        check_full_attention(config)
        from transformers.models.qwen2.modeling_qwen2 import (
            Qwen2DecoderLayer,
            Qwen2RMSNorm,
            Qwen2RotaryEmbedding,
        )

        return Qwen2DecoderLayer, Qwen2RotaryEmbedding, Qwen2RMSNorm


def check_rope(config) -> None:
    """Refuse rotary positions the pipeline cannot run exactly."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type") in _LENGTH_DEPENDENT_ROPE:
        raise DistlmError(
            f"config.json rope_parameters.rope_type {rope['rope_type']!r}: its frequencies depend "
            "on the sequence's length, which the sequences of a micro-batch do not share; "
            f"supported: default, linear, llama3, yarn ({config.model_type})"
        )


def check_full_attention(config) -> None:
    """Refuse sliding-window layers (Qwen's `layer_types`): the pipeline attends over all."""
    sliding = [
        i for i, t in enumerate(getattr(config, "layer_types", None) or []) if t != "full_attention"
    ]
    if sliding:
        raise DistlmError(
            f"config.json layer_types: layers {sliding} use sliding-window attention, which "
            "the pipeline does not run; set use_sliding_window to false"
        )


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's computation: normalised in float32, scaled in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
