"""Tiny seeded Llama-family models for the pipeline tests, written with transformers directly.

Each case is a shape that exercises what the Llama family changes in a pipeline stage: grouped-
query attention with 1 and 2 KV heads (of 4 query heads), tied and untied embeddings, Llama 3.2's
`llama3` rope scaling (its original context set below the tests' positions, so the scaled
frequencies matter), Qwen2's biases on q, k and v, and Qwen3's query/key RMSNorm with a head
width of its own. Every case has 5 decoder layers, which
divide by neither 2 nor 3 stages.

    folders = build_family_models(root, "llama-kv1-tied")
    folders["hf"]     # the transformers folder (save_pretrained), as a hub download holds it
    folders["model"]  # the distlm model folder (distlm.json, the weights' sha256)
    folders[2]        # the pipeline folder of 2 stage shards

Weights are drawn wider than the families' init so that greedy decoding does not settle on one
repeated token and equality tests compare varied sequences.
"""

from __future__ import annotations

from pathlib import Path

import torch

N_LAYER = 5  # divisible by neither 2 nor 3 stages
STAGES = (1, 2, 3)
# Llama 3.2's rope scaling (its rope_theta, factor and frequency bounds), with the original
# context at 16 positions so that the tests' positions (up to 64) reach the scaled wavelengths
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES: dict[str, dict] = {
    "llama-kv1-tied": {"model_type": "llama", "n_kv_head": 1, "tied": True, "rope": None},
    "llama-kv2-untied-llama3": {
        "model_type": "llama",
        "n_kv_head": 2,
        "tied": False,
        "rope": LLAMA3_ROPE,
    },
    "qwen2-kv2-tied": {"model_type": "qwen2", "n_kv_head": 2, "tied": True, "rope": None},
    # Qwen3: query/key RMSNorm, heads of 16 on a width of 32 (head_dim is not width / heads)
    "qwen3-kv2-untied-hd16": {
        "model_type": "qwen3",
        "n_kv_head": 2,
        "tied": False,
        "rope": None,
        "head_dim": 16,
    },
}


def tokenizer_dir(root: Path) -> Path:
    """A byte-level BPE tokenizer of 400 tokens trained on the embedded corpus (once per root)."""
    from distlm.data import load_embedded, train_tokenizer

    tokdir = root / "tokenizer"
    if not (tokdir / "tokenizer.json").is_file():
        train_tokenizer([t for _, t in load_embedded()[:150]], 400, 2, tokdir)
    return tokdir


def family_config(case: str, vocab_size: int, eos_token_id: int):
    """The transformers config of a case: 5 layers, 4 query heads of 8 dims, 64 positions."""
    import transformers

    spec = CASES[case]
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[spec["model_type"]]
    kwargs: dict = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": 4,
        "num_key_value_heads": spec["n_kv_head"],
        "max_position_embeddings": 64,
        "tie_word_embeddings": spec["tied"],
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }
    if spec["rope"]:
        kwargs["rope_parameters"] = dict(spec["rope"])
    if spec["model_type"] in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if "head_dim" in spec:
        kwargs["head_dim"] = spec["head_dim"]
    return cls(**kwargs)


def write_hf_folder(case: str, out: Path, tokdir: Path) -> Path:
    """The case's seeded model and tokenizer, saved by transformers (`save_pretrained`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokdir)
    config = family_config(case, len(tok), tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_family_models(root: Path, case: str) -> dict:
    """The case's transformers folder, distlm model folder and pipeline folders of 1, 2 and 3
    stages (built once per root)."""
    from transformers import AutoModelForCausalLM

    from distlm.model import state_dict_for_save, write_model_dir, write_pipeline_dir

    base = root / case
    done: dict = {"hf": base / "hf", "model": base / "model", **{s: base / f"s{s}" for s in STAGES}}
    if all((done[s] / "shards" / "manifest.json").is_file() for s in STAGES):
        return done
    tokdir = tokenizer_dir(root)
    write_hf_folder(case, done["hf"], tokdir)
    model = AutoModelForCausalLM.from_pretrained(done["hf"], dtype=torch.float32)
    write_model_dir(
        done["model"],
        state_dict=state_dict_for_save(model),
        config=model.config,
        tokenizer_dir=tokdir,
        meta={
            "created_by": "test",
            "source": {"kind": "local", "name": str(done["hf"])},
            "config_digest": "0" * 64,
            "data_config_digest": "0" * 64,
            "dtype": "float32",
        },
    )
    for s in STAGES:
        write_pipeline_dir(done["model"], done[s], stages=s)
    return done
