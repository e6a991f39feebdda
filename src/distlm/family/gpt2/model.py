"""GPT-2's model: init, build, signature, its pipeline blocks and its training kernels."""

from __future__ import annotations

import torch

from distlm.family.gpt2 import GPT2
from distlm.family.model import Family


class GPT2Family(Family):
    def init_config(self, init, vocab_size, eos_token_id):
        return self.config_class(
            vocab_size=vocab_size,
            n_positions=init.n_positions,
            n_embd=init.n_embd,
            n_layer=init.n_layer,
            n_head=init.n_head,
            resid_pdrop=init.dropout,
            embd_pdrop=init.dropout,
            attn_pdrop=init.dropout,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=init.tie_embeddings is not False,  # null = tied
        )

    def signature(self, config) -> dict:
        return {
            k: getattr(config, k)
            for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
        }

    def prepare_training(self, model, kernels: str) -> str:
        """GPT-2's `gelu_new` (transformers' NewGELUActivation, eight element-wise operations
        each way) as torch's tanh GELU, one kernel each way: the same function to float rounding,
        on any device (under torch.compile on a GPU too, as nanoGPT's MLP)."""
        from transformers.activations import NewGELUActivation

        n = 0
        for module in model.modules():
            if isinstance(getattr(module, "act", None), NewGELUActivation):
                module.act = torch.nn.GELU(approximate="tanh")
                n += 1
        return f"{n} tanh GELUs in one kernel" if n else ""

    def blocks_class(self):
        from distlm.family.gpt2.blocks import GPT2Blocks

        return GPT2Blocks


FAMILY = GPT2Family(GPT2)
