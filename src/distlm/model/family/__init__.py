"""Model families: the one place that knows an architecture. Every stage asks `family_of(config)`
and never branches on `model_type`.

    fam = family_of(config)                  # or family_of("llama"); DistlmError if unsupported
    config = fam.init_config(init, vocab_size, eos_token_id)
    model = fam.build(config, seed=0)
    fam.tied(config)                         # {"lm_head.weight": "<embedding>"} when tied
    fam.layer_of("model.layers.3.mlp.up_proj.weight")  # 3: the pipeline cut by tensor name

Supported: GPT-2 (`gpt2`, `GPT2LMHeadModel`) and the Llama family: Llama (`llama`,
`LlamaForCausalLM`: SmolLM2, TinyLlama, Llama 3.2) and Qwen2 (`qwen2`, `Qwen2ForCausalLM`: Llama
with biases on the query, key and value projections; Qwen2.5).
"""

from __future__ import annotations

from typing import get_args

from distlm import DistlmError
from distlm.model.family.base import Family
from distlm.model.family.gpt2 import GPT2
from distlm.model.family.llama import LLAMA, QWEN2
from distlm.settings.model import Architecture

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GPT2, LLAMA, QWEN2)}
SUPPORTED: tuple[str, ...] = tuple(FAMILIES)
# model.init.architecture names the same set (settings cannot import the model layer)
assert SUPPORTED == get_args(Architecture), (SUPPORTED, get_args(Architecture))


def family_of(config_or_model_type, *, where: str = "model") -> Family:
    """The family of a transformers config (or a model_type); an unsupported one is refused with
    the supported types named. `where` names the file or key the config came from."""
    model_type = (
        config_or_model_type
        if isinstance(config_or_model_type, str)
        else getattr(config_or_model_type, "model_type", None)
    )
    family = FAMILIES.get(model_type)  # pyright: ignore[reportArgumentType]
    if family is None:
        raise DistlmError(
            f"{where}: model_type {model_type!r} is not supported; distlm supports "
            f"{', '.join(SUPPORTED)}"
        )
    return family


__all__ = ["FAMILIES", "SUPPORTED", "Family", "family_of"]
