"""Where a model comes from: a GPT-2 config for a seeded random init, the model built from a
config, a hub id or local Hugging Face folder (`model.source`), and its state dict to save."""

from __future__ import annotations

from pathlib import Path

import torch

from distlm import DistlmError
from distlm.model.layout import (
    TIED,
)
from distlm.settings import ModelInitSettings, ModelSourceSettings


def init_config(init: ModelInitSettings, vocab_size: int, eos_token_id: int | None):
    """The GPT-2 architecture of a random init (`model.init`) for this vocabulary."""
    from transformers import GPT2Config

    return GPT2Config(
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
        tie_word_embeddings=True,
    )


def build_model(config, *, seed: int | None = None):
    """A GPT2LMHeadModel with SDPA attention; seeded random init when `seed` is given."""
    from transformers import GPT2LMHeadModel

    config._attn_implementation = "sdpa"
    if seed is not None:
        torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def load_source(mcfg: ModelSourceSettings):
    """Model from a hub id or a local HF folder, in float32; errors name the id or folder."""
    from transformers import GPT2LMHeadModel

    name, local = mcfg.name, mcfg.source == "local"
    if not name:  # Settings refuses this
        raise DistlmError(f"model.name: required when model.source is {mcfg.source}")
    if local and not Path(name).is_dir():
        raise DistlmError(f"model.name: model folder not found: {name}")
    try:
        model = GPT2LMHeadModel.from_pretrained(
            name,
            revision=mcfg.revision or "main",  # transformers' own default
            local_files_only=local,
            torch_dtype=torch.float32,
            attn_implementation="sdpa",
        )
    except Exception as e:
        hint = "" if local else " Unknown model id, or offline without a cached copy?"
        raise DistlmError(
            f"model.name {name!r}: could not load the model ({type(e).__name__}: {e}).{hint}"
        ) from None
    if model.config.model_type != "gpt2":
        raise DistlmError(f"model.name {name!r}: model_type {model.config.model_type!r}, need gpt2")
    return model


def state_dict_for_save(model) -> dict[str, torch.Tensor]:
    """The model's state dict without tied duplicates, contiguous, on the CPU."""
    sd = model.state_dict()
    for dup, src in TIED.items():
        if dup in sd and src in sd and model.config.tie_word_embeddings:
            del sd[dup]
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
