"""The Llama family: Llama (`LlamaForCausalLM`) and Qwen2 (`Qwen2ForCausalLM`, Llama with biases
on the query, key and value projections). Rotary positions (with `rope_scaling` such as Llama
3.2's `llama3`), RMSNorm, a gated SiLU MLP, grouped-query attention (`num_key_value_heads` KV
heads), tied or untied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

from distlm.model.family.base import Family

# model.init's defaults where the Llama family has a key GPT-2 lacks (config/README.md)
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5


@dataclass(frozen=True)
class LlamaFamily(Family):
    def init_config(self, init, vocab_size, eos_token_id):
        rope: dict = {
            "rope_type": "default",
            "rope_theta": init.rope_theta if init.rope_theta is not None else ROPE_THETA,
        }
        if init.rope_scaling is not None:
            rope.update(init.rope_scaling.model_dump())
        kwargs = {
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
        if self.model_type == "qwen2":
            kwargs["use_sliding_window"] = False
        return self.config_class(**kwargs)

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

    def stage_blocks(self, config, start, end, *, first, last, kernels="standard"):
        from distlm.model.family.llama_blocks import LlamaBlocks

        return LlamaBlocks(config, start, end, first=first, last=last, kernels=kernels)


def _llama(model_type: str, architecture: str, config_name: str) -> LlamaFamily:
    return LlamaFamily(
        model_type=model_type,
        architecture=architecture,
        config_name=config_name,
        layers="model.layers.",
        embeddings=("model.embed_tokens.",),
        final=("model.norm.", "lm_head."),
        embedding="model.embed_tokens.weight",
        kernels=frozenset({"linear_ce"}),  # SiLU MLP: no GPT-2 tanh GELU to fuse
    )


LLAMA = _llama("llama", "LlamaForCausalLM", "LlamaConfig")
QWEN2 = _llama("qwen2", "Qwen2ForCausalLM", "Qwen2Config")
