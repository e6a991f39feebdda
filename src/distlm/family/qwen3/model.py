"""Qwen3's model: the Llama family's with a head width of its own and query/key RMSNorm."""

from __future__ import annotations

from distlm.family.llama.model import LlamaFamily
from distlm.family.qwen3 import QWEN3


class Qwen3Family(LlamaFamily):
    def init_config(self, init, vocab_size, eos_token_id):
        kwargs = self.config_kwargs(init, vocab_size, eos_token_id)
        head_dim = init.head_dim or init.n_embd // init.n_head
        return self.config_class(
            **kwargs, head_dim=head_dim, attention_bias=False, use_sliding_window=False
        )

    def signature(self, config) -> dict:
        return {**super().signature(config), "head_dim": config.head_dim}

    def blocks_class(self):
        from distlm.family.qwen3.blocks import Qwen3Blocks

        return Qwen3Blocks


FAMILY = Qwen3Family(QWEN3)
