"""The five model shapes distlm supports, tiny, as transformers' config classes take them, and
(transformers' model, distlm's model) of the same seeded weights: tests/test_family_model.py
checks the two against each other, tests/test_packing.py runs packed batches on them."""

from __future__ import annotations

import torch
from harness.families import LLAMA3_ROPE

from distlm.family import family_of, model_args

VOCAB, CONTEXT = 96, 48
# config.json of each shape, as transformers' config classes take them
SHAPES: dict[str, dict] = {
    "gpt2": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 32,
        "n_positions": CONTEXT,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "llama-gqa-untied": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": False,
        "rope_parameters": LLAMA3_ROPE,
    },
    "qwen2-qkv-bias": {
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "qwen3-qk-norm-hd16": {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "head_dim": 16,
        "intermediate_size": 48,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": False,
    },
    # SmolLM2-135M's proportions: heads of 16 (its 64 scaled down), 3 query heads per KV head, the
    # MLP 8/3 of the width, tied embeddings, rope_theta 1e5
    "smollm2-shape": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "hidden_size": 96,
        "intermediate_size": 256,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
}


def hf_config(shape: str):
    import transformers

    doc = dict(SHAPES[shape])
    cls = transformers.AutoConfig.for_model(doc.pop("model_type"), vocab_size=VOCAB, **doc)
    return cls


def models(shape: str, *, seed: int = 0):
    """(transformers' model, distlm's model) of the same weights, drawn wider than the families'
    init (biases and norms too) so that every part of the math moves the result."""
    from transformers import AutoModelForCausalLM

    config = hf_config(shape)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base = 1.0 if "norm" in name or "ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.1))
    args = model_args(config.to_dict(), shape)
    ours = family_of(args).build(args)
    ours.load_hf(dict(hf.named_parameters()), shape)
    return hf, ours


def ids(batch: int = 3, length: int = CONTEXT, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
