"""The Llama family's model (Llama and Qwen2): init, build, signature, its pipeline blocks."""

from __future__ import annotations

from distlm.family.llama import LLAMA, QWEN2, RMS_NORM_EPS, ROPE_THETA
from distlm.family.model import Family


class LlamaFamily(Family):
    def config_kwargs(self, init, vocab_size, eos_token_id) -> dict:
        """The config of a seeded init as keyword arguments (Qwen3 adds its own)."""
        rope: dict = {
            "rope_type": "default",
            "rope_theta": init.rope_theta if init.rope_theta is not None else ROPE_THETA,
        }
        if init.rope_scaling is not None:
            rope.update(init.rope_scaling.model_dump())
        return {
            "vocab_size": vocab_size,
            "hidden_size": init.n_embd,
            "intermediate_size": init.intermediate_size or 4 * init.n_embd,
            "num_hidden_layers": init.n_layer,
            "num_attention_heads": init.n_head,
            "num_key_value_heads": init.n_kv_head or init.n_head,
            "max_position_embeddings": init.n_positions,
            "rms_norm_eps": init.rms_norm_eps if init.rms_norm_eps is not None else RMS_NORM_EPS,
            "rope_parameters": rope,
            "tie_word_embeddings": init.tie_embeddings if init.tie_embeddings is not None else True,
            "attention_dropout": init.dropout,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
        }

    def init_config(self, init, vocab_size, eos_token_id):
        return self.config_class(**self.config_kwargs(init, vocab_size, eos_token_id))

    def signature(self, config) -> dict:
        return {
            k: getattr(config, k)
            for k in (
                "model_type",
                "vocab_size",
                "max_position_embeddings",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "tie_word_embeddings",
            )
        }

    def kv_shape(self, config) -> tuple[int, int]:
        head_dim = getattr(config, "head_dim", None) or self.n_embd(config) // self.n_head(config)
        return int(config.num_key_value_heads or self.n_head(config)), int(head_dim)

    def blocks_class(self):
        from distlm.family.llama.blocks import LlamaBlocks

        return LlamaBlocks


class Qwen2Family(LlamaFamily):
    def init_config(self, init, vocab_size, eos_token_id):
        kwargs = self.config_kwargs(init, vocab_size, eos_token_id)
        return self.config_class(**kwargs, use_sliding_window=False)

    def blocks_class(self):
        from distlm.family.llama.blocks import Qwen2Blocks

        return Qwen2Blocks


LLAMA_FAMILY = LlamaFamily(LLAMA)
QWEN2_FAMILY = Qwen2Family(QWEN2)
