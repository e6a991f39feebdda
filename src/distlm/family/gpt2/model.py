"""GPT-2's model: its blocks put together, the map between its tensor names and transformers'
(`GPT2LMHeadModel`'s, Conv1D weights transposed), and its seeded init's config."""

from __future__ import annotations

from torch import nn

from distlm.family.builder import Family
from distlm.family.gpt2 import GPT2, GPT2Args
from distlm.family.gpt2.blocks import GPT2Block, GPT2Embedding
from distlm.family.transformer import Rule, Transformer

_H = "transformer.h.{i}."


class GPT2Model(Transformer):
    args: GPT2Args
    embedding: GPT2Embedding

    def make_embedding(self) -> nn.Module:
        return GPT2Embedding(self.args)

    def make_block(self, layer: int) -> GPT2Block:
        return GPT2Block(self.args, layer)

    def make_norm(self) -> nn.Module:
        return nn.LayerNorm(self.args.dim, eps=self.args.norm_eps)

    def embedding_weight(self) -> nn.Parameter:
        return self.embedding.wte.weight  # pyright: ignore[reportReturnType] (a Parameter)

    def tensor_rules(self) -> list[Rule]:
        rules = [
            Rule("embedding.wte.weight", ("transformer.wte.weight",)),
            Rule("embedding.wpe.weight", ("transformer.wpe.weight",)),
            Rule("norm.weight", ("transformer.ln_f.weight",)),
            Rule("norm.bias", ("transformer.ln_f.bias",)),
            Rule("lm_head.weight", ("lm_head.weight",)),
        ]
        for ours, hf in (
            ("ln_1", "ln_1"),
            ("attn.qkv", "attn.c_attn"),
            ("attn.proj", "attn.c_proj"),
            ("ln_2", "ln_2"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            conv1d = not hf.startswith("ln_")  # a linear layer's weight, transposed
            rules += [
                Rule(
                    f"layers.{{i}}.{ours}.weight", (f"{_H}{hf}.weight",), "t" if conv1d else "same"
                ),
                Rule(f"layers.{{i}}.{ours}.bias", (f"{_H}{hf}.bias",)),
            ]
        return rules

    def hf_order(self) -> list[str]:
        # GPT2LMHeadModel registers its parameters in the order this model does, one for one
        tmap = self.tensor_map()
        return [h for name, _ in self.named_parameters() for h in tmap.hf_names(name)]


FAMILY = Family(GPT2, GPT2Model)
