"""Where a model comes from (the model stage's side, which writes transformers' format with
transformers itself): the config of a seeded random init (`model.init`, of the family its
`architecture` names) and its seeded transformers model, a hub id or local Hugging Face folder
(`model.source`) of a supported family, and its state dict to save. Every other stage runs
distlm's own model of the family (distlm.family), loaded from the folder this stage writes."""

from __future__ import annotations

from pathlib import Path

import torch

from distlm import DistlmError
from distlm.family import InitSettings, family_of
from distlm.settings import ModelSourceSettings


def init_config(init: InitSettings, vocab_size: int, eos_token_id: int | None):
    """The architecture of a random init (`model.init`) for this vocabulary."""
    family = family_of(init.architecture, where="model.init.architecture")
    return family.init_config(init, vocab_size, eos_token_id)


def init_model(config, *, seed: int):
    """transformers' model of `config`'s family, seeded: the random init of model.source init."""
    return family_of(config).init_model(config, seed=seed)


def load_source(mcfg: ModelSourceSettings):
    """Model from a hub id or a local HF folder, in float32; errors name the id or folder. A
    model_type distlm does not support is refused naming the supported ones (a local folder's
    before the weights are read)."""
    from transformers import AutoConfig

    name, local = mcfg.name, mcfg.source == "local"
    if not name:  # Settings refuses this
        raise DistlmError(f"model.name: required when model.source is {mcfg.source}")
    if local and not Path(name).is_dir():
        raise DistlmError(f"model.name: model folder not found: {name}")
    revision = mcfg.revision or "main"  # transformers' own default
    hint = "" if local else " Unknown model id, or offline without a cached copy?"
    try:
        config = AutoConfig.from_pretrained(name, revision=revision, local_files_only=local)
    except Exception as e:
        raise DistlmError(
            f"model.name {name!r}: could not read the model's config ({type(e).__name__}: {e})."
            f"{hint}"
        ) from None
    family = family_of(config, where=f"model.name {name!r}")
    try:
        model = family.hf_model_class.from_pretrained(
            name,
            revision=revision,
            local_files_only=local,
            dtype=torch.float32,
            attn_implementation="sdpa",
        )
    except Exception as e:
        raise DistlmError(
            f"model.name {name!r}: could not load the model ({type(e).__name__}: {e}).{hint}"
        ) from None
    return model


def state_dict_for_save(model) -> dict[str, torch.Tensor]:
    """A transformers model's state dict without a tied head (as transformers saves it),
    contiguous, on the CPU."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        t = family_of(model.config).tensors
        if t.head in sd and t.embedding in sd:
            del sd[t.head]
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
