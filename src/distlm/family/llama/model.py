"""The Llama family's model (Llama, Qwen2; Qwen3 builds on it): its blocks put together, the map
between its tensor names and transformers' (q|k|v and gate|up split into transformers'
projections), and its seeded init's config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distlm.family.builder import Family
from distlm.family.llama import LLAMA, QWEN2, LlamaArgs
from distlm.family.llama.blocks import LlamaBlock, Rotary
from distlm.family.transformer import Embedding, RMSNorm, Rule, Transformer

_L = "model.layers.{i}."


class LlamaEmbedding(Embedding):
    """embed_tokens: token ids -> hidden states (positions enter through rotary)."""

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().forward(ids)


class LlamaModel(Transformer):
    args: LlamaArgs
    embedding: LlamaEmbedding

    def __init__(self, args: LlamaArgs, **cut: Any) -> None:
        super().__init__(args, **cut)
        self.rotary = Rotary(args)  # every stage has one: it holds no weights

    def make_embedding(self) -> nn.Module:
        return LlamaEmbedding(self.args.vocab_size, self.args.dim)

    def make_block(self, layer: int) -> LlamaBlock:
        return LlamaBlock(self.args, layer)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.args.dim, self.args.norm_eps)

    def embedding_weight(self) -> nn.Parameter:
        return self.embedding.weight

    def positions(self, pos: torch.Tensor, dtype: torch.dtype) -> Any:
        return self.rotary(pos, dtype)

    def tensor_rules(self) -> list[Rule]:
        a = self.args
        D = a.head_dim
        qkv = (a.n_heads * D, a.n_kv_heads * D, a.n_kv_heads * D)
        attn = _L + "self_attn."
        rules = [
            Rule("embedding.weight", ("model.embed_tokens.weight",)),
            Rule("norm.weight", ("model.norm.weight",)),
            Rule("lm_head.weight", ("lm_head.weight",)),
            Rule("layers.{i}.attn_norm.weight", (_L + "input_layernorm.weight",)),
            Rule("layers.{i}.mlp_norm.weight", (_L + "post_attention_layernorm.weight",)),
            Rule("layers.{i}.attn.q_norm.weight", (attn + "q_norm.weight",)),
            Rule("layers.{i}.attn.k_norm.weight", (attn + "k_norm.weight",)),
        ]
        for p in ("weight", "bias"):
            rules += [
                Rule(
                    f"layers.{{i}}.attn.qkv.{p}",
                    tuple(f"{attn}{x}_proj.{p}" for x in "qkv"),
                    "cat",
                    qkv,
                ),
                Rule(f"layers.{{i}}.attn.o.{p}", (f"{attn}o_proj.{p}",)),
                Rule(
                    f"layers.{{i}}.mlp.gate_up.{p}",
                    (f"{_L}mlp.gate_proj.{p}", f"{_L}mlp.up_proj.{p}"),
                    "cat",
                    (a.mlp_dim, a.mlp_dim),
                ),
                Rule(f"layers.{{i}}.mlp.down.{p}", (f"{_L}mlp.down_proj.{p}",)),
            ]
        return rules

    def hf_order(self) -> list[str]:
        # LlamaForCausalLM's order: embed_tokens; each decoder layer's self_attn (q, k, v, o,
        # each weight then bias; Qwen3's q_norm, k_norm), mlp (gate, up, down), input and
        # post-attention norms; the final norm; an untied lm_head
        have = set(self.hf_tensors())
        layer = [
            *(f"self_attn.{x}_proj.{p}" for x in "qkvo" for p in ("weight", "bias")),
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            *(f"mlp.{x}_proj.{p}" for x in ("gate", "up", "down") for p in ("weight", "bias")),
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
        order = [
            "model.embed_tokens.weight",
            *(f"model.layers.{i}.{n}" for i in range(self.start, self.end) for n in layer),
            "model.norm.weight",
            "lm_head.weight",
        ]
        return [n for n in order if n in have]


LLAMA_FAMILY = Family(LLAMA, LlamaModel)
QWEN2_FAMILY = Family(QWEN2, LlamaModel)
