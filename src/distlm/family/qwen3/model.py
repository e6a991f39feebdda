"""Qwen3's model: the Llama family's (its blocks norm each head's queries and keys, as its args
say), with a seeded init's config of its own (head_dim)."""

from __future__ import annotations

from distlm.family.llama.model import LlamaFamily, LlamaModel
from distlm.family.qwen3 import QWEN3


class Qwen3Family(LlamaFamily):
    def init_config(self, init, vocab_size, eos_token_id):
        kwargs = self.config_kwargs(init, vocab_size, eos_token_id)
        head_dim = init.head_dim or init.n_embd // init.n_head
        return self.config_class(
            **kwargs, head_dim=head_dim, attention_bias=False, use_sliding_window=False
        )


FAMILY = Qwen3Family(QWEN3, LlamaModel)
