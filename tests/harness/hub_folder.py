"""A model folder shaped as HuggingFaceTB/SmolLM2-135M ships on the hub (config.json, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, model.safetensors), with
its keys and special tokens as that repository has them, but small: a byte-level BPE of a few
hundred tokens trained here, 2 layers of width 48, random weights."""

from __future__ import annotations

import json
from pathlib import Path

# SmolLM2's special tokens, in its vocabulary's order (ids 0..16)
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]


def _token(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def smollm2_shaped_folder(root: Path, texts: list[str], *, vocab_size: int = 384) -> Path:
    """Write the folder under root/smollm2-tiny and return it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(root) / "smollm2-tiny"
    out.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2)
    bpe.save(str(out / "tokenizer.json"))
    vocab = bpe.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 48,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 128,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 3,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "vocab_size": vocab,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "_from_model_config": True,
                "bos_token_id": 0,
                "eos_token_id": 0,
                "transformers_version": "4.40.1",
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "additional_special_tokens": SPECIAL,
                "bos_token": _token("<|endoftext|>"),
                "eos_token": _token("<|endoftext|>"),
                "unk_token": _token("<|endoftext|>"),
            },
            indent=2,
        )
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": False,
                "added_tokens_decoder": {
                    str(i): {**_token(t), "special": True} for i, t in enumerate(SPECIAL)
                },
                "additional_special_tokens": SPECIAL,
                "bos_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False,
                "eos_token": "<|endoftext|>",
                "model_max_length": 8192,
                "tokenizer_class": "GPT2Tokenizer",
                "unk_token": "<|endoftext|>",
                "vocab_size": vocab,
            },
            indent=2,
        )
    )
    _write_weights(out, LlamaForCausalLM, LlamaConfig)
    return out


def _write_weights(out: Path, model_class, config_class) -> None:
    """Random weights in bfloat16, as the hub's files hold them; the tied head is not stored."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = model_class(config_class.from_json_file(str(out / "config.json")))
    sd = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


# Qwen3's special tokens, in its vocabulary's order (Qwen3-0.6B: ids 151643-151645 of many more)
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen3_shaped_folder(root: Path, texts: list[str], *, vocab_size: int = 384) -> Path:
    """A folder shaped as Qwen/Qwen3-0.6B ships (its config keys: a head width of its own,
    `head_dim`, query/key RMSNorm, rope_theta 1e6, tied embeddings), small: 2 layers of width 32,
    4 query heads of 16 (q_proj 32 -> 64, as Qwen3-0.6B's 1024 -> 2048), 2 KV heads, random
    weights in bfloat16. Written under root/qwen3-tiny; returned."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(root) / "qwen3-tiny"
    out.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, special_tokens=QWEN3_SPECIAL, min_frequency=2
    )
    bpe.save(str(out / "tokenizer.json"))
    vocab = bpe.get_vocab_size()
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 0, "transformers_version": "4.51.0"})
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": False,
                "added_tokens_decoder": {
                    str(i): {**_token(t), "special": True} for i, t in enumerate(QWEN3_SPECIAL)
                },
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
                "eos_token": "<|endoftext|>",
                "model_max_length": 131072,
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "Qwen2Tokenizer",
            },
            indent=2,
        )
    )
    _write_weights(out, Qwen3ForCausalLM, Qwen3Config)
    return out
