"""Model families: the registry, one line a family, and the one lookup every stage asks.

    spec = REGISTRY["llama"]                 # FamilySpec: name, classes, init settings, table
    args = model_args(config_json, where)    # config.json (a dict) -> ModelArgs (no torch)
    fam = family_of(args)                    # or family_of("llama"): its model (imports torch)
    model = fam.build(args, device="cuda")   # distlm's model (distlm.family.transformer)
    model.load_hf(tensors, where)            # its weights, in transformers' names
    fam.tensors.layer_of("model.layers.3.mlp.up_proj.weight")  # 3: the pipeline cut

A family is a folder here (`gpt2/`, `llama/`): its spec, config mapping and tensor table in
`__init__.py` (no torch: the settings build `model.init` from it while the workflow plans the
DAG; the table, `distlm.family.table`, declares each parameter once, and its names, its map to
transformers' names and the parameter count are derived from it), its blocks' math in
`blocks.py`, its model (the blocks put together) in `model.py`. Adding one is a folder and a
line below; nothing outside these folders names a family.

One rule places a family: one whose blocks are its own is a folder; one that runs another's
blocks, and differs in config keys, defaults, biases or norms those blocks already know, is a
variant in that folder (Qwen2 and Qwen3 are Llama's: `llama/qwen.py`). A variant is a spec and a
config mapping, no model code.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distlm import DistlmError
from distlm.family.gpt2 import GPT2
from distlm.family.llama import LLAMA
from distlm.family.llama.qwen import QWEN2, QWEN3
from distlm.family.spec import FamilySpec, InitSettings, ModelArgs
from distlm.family.table import Cut, TensorTable

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
    return _family(spec_of(model_type, where=where).name)


@functools.cache
def _family(name: str) -> Family:
    # the model (torch) is imported when first asked for, by name: the settings read this
    # registry while the workflow plans the DAG, without torch
    spec = REGISTRY[name]
    module, _, cls = spec.model.partition(":")
    family = importlib.import_module("distlm.family.builder").Family
    return family(spec, getattr(importlib.import_module(module), cls))


__all__ = [
    "DEFAULT",
    "REGISTRY",
    "SUPPORTED",
    "Cut",
    "FamilySpec",
    "InitSettings",
    "ModelArgs",
    "TensorTable",
    "family_of",
    "model_args",
    "spec_of",
]
