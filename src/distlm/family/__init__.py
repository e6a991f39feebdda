"""Model families: the registry, one line a family, and the one lookup every stage asks.

    spec = REGISTRY["llama"]                 # FamilySpec: name, classes, init settings, tensors
    fam = family_of(config)                  # or family_of("llama"): its model (imports torch)
    config = fam.init_config(init, vocab_size, eos_token_id)
    model = fam.build(config, seed=0)
    fam.logits(model.lm_head, hidden)        # the logits hook: training, evaluation, the engine
    fam.tensors.layer_of("model.layers.3.mlp.up_proj.weight")  # 3: the pipeline cut

A family is a folder here (`gpt2/`, `llama/`, `qwen3/`): its spec in `__init__.py` (no torch: the
settings build `model.init` from it while the workflow plans the DAG), its model in `model.py`
and its pipeline stage's math in `blocks.py`. Adding one is a folder and a line below; nothing
outside these folders names a family.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from distlm import DistlmError
from distlm.family.gpt2 import GPT2
from distlm.family.llama import LLAMA, QWEN2
from distlm.family.qwen3 import QWEN3
from distlm.family.spec import FamilySpec, InitSettings, TensorNames

if TYPE_CHECKING:
    from distlm.family.model import Family

# The registry: one line a family (the first is model.init's default architecture).
REGISTRY: dict[str, FamilySpec] = {s.name: s for s in (GPT2, LLAMA, QWEN2, QWEN3)}
SUPPORTED: tuple[str, ...] = tuple(REGISTRY)
DEFAULT: str = SUPPORTED[0]


def spec_of(model_type: object, *, where: str = "model") -> FamilySpec:
    """The spec of a model_type; an unsupported one is refused naming the supported ones and
    `where` (the file or key it came from)."""
    spec = REGISTRY.get(model_type)  # pyright: ignore[reportArgumentType]
    if spec is None:
        raise DistlmError(
            f"{where}: model_type {model_type!r} is not supported; distlm supports "
            f"{', '.join(SUPPORTED)}"
        )
    return spec


def family_of(config_or_model_type, *, where: str = "model") -> Family:
    """The family of a transformers config (or a model_type): its model (`Family`, with torch)."""
    model_type = (
        config_or_model_type
        if isinstance(config_or_model_type, str)
        else getattr(config_or_model_type, "model_type", None)
    )
    module, _, name = spec_of(model_type, where=where).model.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT",
    "REGISTRY",
    "SUPPORTED",
    "FamilySpec",
    "InitSettings",
    "TensorNames",
    "family_of",
    "spec_of",
]
