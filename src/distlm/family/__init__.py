"""Model families: the registry, one line a family, and the one lookup every stage asks.

    spec = REGISTRY["llama"]                 # FamilySpec: name, classes, init settings, tensors
    args = model_args(config_json, where)    # config.json (a dict) -> ModelArgs (no torch)
    fam = family_of(args)                    # or family_of("llama"): its model (imports torch)
    model = fam.build(args, device="cuda")   # distlm's model (distlm.family.transformer)
    model.load_hf(tensors, where)            # its weights, in transformers' names
    fam.tensors.layer_of("model.layers.3.mlp.up_proj.weight")  # 3: the pipeline cut

A family is a folder here (`gpt2/`, `llama/`, `qwen3/`): its spec and config mapping in
`__init__.py` (no torch: the settings build `model.init` from it while the workflow plans the
DAG), its blocks' math in `blocks.py`, its model and the map between its tensor names and
transformers' in `model.py`. Adding one is a folder and a line below; nothing outside these
folders names a family.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distlm import DistlmError
from distlm.family.gpt2 import GPT2
from distlm.family.llama import LLAMA, QWEN2
from distlm.family.qwen3 import QWEN3
from distlm.family.spec import FamilySpec, InitSettings, ModelArgs, TensorNames

if TYPE_CHECKING:
    from distlm.family.builder import Family

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


def model_args(doc: Mapping[str, Any], where: str) -> ModelArgs:
    """config.json (its mapping; `where` names the file) -> the ModelArgs of its family: a
    model_type distlm does not support, or a key its model cannot run, is refused naming both."""
    if not isinstance(doc, Mapping):
        raise DistlmError(f"{where}: not a model config (a JSON object)")
    return spec_of(doc.get("model_type"), where=where).args(doc, where)


def family_of(what, *, where: str = "model") -> Family:
    """The family of a model_type, ModelArgs or transformers config: its model (`Family`, with
    torch)."""
    model_type = what if isinstance(what, str) else getattr(what, "model_type", None)
    module, _, name = spec_of(model_type, where=where).model.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT",
    "REGISTRY",
    "SUPPORTED",
    "FamilySpec",
    "InitSettings",
    "ModelArgs",
    "TensorNames",
    "family_of",
    "model_args",
    "spec_of",
]
