"""What a model family is, without torch: its name, transformers' classes, its `model.init`
settings as a typed model, its config mapping (config.json -> `ModelArgs`, what distlm's model is
built from) and its tensor table (distlm.family.table: its parameters, their transformers names,
the parameter count and the pipeline cut).

The registry (`distlm.family.REGISTRY`) holds one `FamilySpec` a family; each family's folder
(`distlm/family/<name>/`) holds its spec, config mapping and table (`__init__.py`, read by the
settings while the workflow builds the DAG) and, with torch, its blocks (`blocks.py`: the
model's math) and its model (`model.py`: the blocks put together).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from distlm import DistlmError
from distlm.core.section import ONLY_WHEN_SET, Real, Section
from distlm.family.table import TensorTable


class InitSettings(Section):
    """`model.init`: the architecture of a seeded random init (model.source init). The keys every
    family has; a family's own subclass adds its keys and its `architecture` name."""

    # The family's registry name (config.json's model_type); each family's class fixes it.
    architecture: str = Field(description="The model family (config.json's model_type).")
    # The default family's name dumps as absent (its Init sets this), so that a config that
    # never named one hashes as it always did.
    DUMPS_ARCHITECTURE: ClassVar[bool] = True
    n_layer: int = Field(default=4, ge=1, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, description="Attention heads; must divide n_embd.")
    n_embd: int = Field(default=128, ge=8, description="Width of the residual stream.")
    n_positions: int = Field(default=256, ge=8, description="Context length (positions).")
    dropout: Real = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Residual, embedding and attention dropout (GPT-2); attention dropout (the Llama "
            "family, which has no other)."
        ),
    )
    seed: int = Field(
        default=0, ge=0, description="Seed of the initial weights: the same seed, the same bits."
    )
    tie_embeddings: bool | None = Field(
        default=None,
        description="The LM head is the input embedding; null = true.",
        **ONLY_WHEN_SET,
    )

    def _dumped(self, out: dict) -> dict:
        # the default family and unset keys dump as absent: the mapping (and so the model stage's
        # params and every digest made of them) of a config without them is what it always was
        drop = () if self.DUMPS_ARCHITECTURE else ("architecture",)
        return {k: v for k, v in out.items() if not (v is None or k in drop)}

    @property
    def head_width(self) -> int | None:
        """Each attention head's width: n_embd / n_head (None when n_head does not divide
        n_embd); a family with a key of its own for it overrides this."""
        return None if self.n_embd % self.n_head else self.n_embd // self.n_head

    def problems(self) -> list[str]:
        """What the keys together make impossible, each naming its key (model.init.<key>); a
        family adds its own."""
        if self.head_width is None:
            return [
                (
                    f"model.init.n_embd: {self.n_embd} is not divisible by model.init.n_head "
                    f"{self.n_head}"
                )
            ]
        return []


# ----------------------------------------------------------------------------- model args


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """What distlm's model of a family is built from: config.json's architecture, read by the
    family's config mapping (`FamilySpec.args`) with transformers' defaults for absent keys. The
    keys every family has; a family's subclass adds its own."""

    # the family's parameters, declared once (distlm.family.table); each family's subclass sets it
    TABLE: ClassVar[TensorTable]
    model_type: str  # config.json's model_type: the family
    vocab_size: int  # V
    dim: int  # C, the residual stream's width
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (fewer than n_heads: grouped-query attention)
    head_dim: int  # D
    context: int  # positions the model was built for
    mlp_dim: int  # the MLP's inner width
    norm_eps: float
    act: str  # the MLP's activation (transformers' ACT2FN name)
    tied: bool  # the LM head is the input embedding
    attn_dropout: float = 0.0  # dropout of the attention probabilities, in training

    @property
    def gqa(self) -> bool:
        """Grouped-query attention: each key/value head serves n_heads / n_kv_heads queries."""
        return self.n_kv_heads != self.n_heads

    def signature(self) -> dict[str, Any]:
        """What must agree between a checkpoint and the model it claims to be (a model folder's
        arch_digest), in config.json's names: the family's."""
        raise NotImplementedError(self.model_type)

    def parameters(self) -> int:
        """How many parameters the model has (a tied head counted once): its table's."""
        return self.TABLE.parameters(self)

    def block_parameters(self) -> int:
        """How many parameters one of its blocks has (every block has as many): what a sharded
        layout gathers whole at a time (distlm.settings.layout_rules)."""
        return self.TABLE.block_parameters(self)


class ConfigDoc:
    """config.json as a family's config mapping reads it: each key of the type it must have, or
    transformers' default when absent; a wrong one is an error naming the file and the key."""

    def __init__(self, doc: Mapping[str, Any], where: str) -> None:
        if not isinstance(doc, Mapping):
            raise DistlmError(f"{where}: not a model config (a JSON object)")
        self.doc, self.where = doc, where

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` the config holds (not null), else `default`."""
        for k in keys:
            if self.doc.get(k) is not None:
                return self.doc[k]
        return default

    def bad(self, key: str, want: str) -> DistlmError:
        return DistlmError(f"{self.where}: {key} is {self.doc.get(key)!r}; expected {want}")

    def integer(self, *keys: str, default: int | None = None, least: int = 1) -> int:
        v = self.get(*keys, default=default)
        key = next((k for k in keys if self.doc.get(k) is not None), keys[0])
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise self.bad(key, f"an integer of at least {least}")
        return v

    def number(self, *keys: str, default: float | None = None, least: float = 0.0) -> float:
        v = self.get(*keys, default=default)
        key = next((k for k in keys if self.doc.get(k) is not None), keys[0])
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.bad(key, "a number")
        if v < least:
            raise self.bad(key, f"a number of at least {least}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.get(key, default=default)
        if not isinstance(v, bool):
            raise self.bad(key, "true or false")
        return v

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.get(key, default=default)
        if v not in choices:
            raise DistlmError(
                f"{self.where}: {key} {v!r} is not supported by distlm's model; supported: "
                f"{', '.join(choices)}"
            )
        return v


# the MLP activations distlm's blocks compute, declared once: transformers' ACT2FN name -> the
# torch.nn.functional function and its keywords that compute it (distlm.family.transformer's
# `activation` makes it; the families' config mappings accept these names). GPT-2's gelu_new is
# the tanh approximation, as gelu_pytorch_tanh (the same function to float rounding).
ACTIVATIONS: dict[str, tuple[str, dict[str, str]]] = {
    "gelu_new": ("gelu", {"approximate": "tanh"}),
    "gelu_pytorch_tanh": ("gelu", {"approximate": "tanh"}),
    "gelu": ("gelu", {}),
    "relu": ("relu", {}),
    "silu": ("silu", {}),
    "swish": ("silu", {}),
}


@dataclass(frozen=True)
class FamilySpec:
    """One model family, registered once (distlm.family.REGISTRY)."""

    name: str  # config.json's model_type, and model.init.architecture
    architecture: str  # config.json's `architectures`: the transformers class that loads it
    config_name: str  # the transformers config class (the model stage writes config.json with it)
    init: type[InitSettings]  # its model.init settings
    tensors: TensorTable  # its parameters, declared once (distlm.family.table)
    model: str  # its model class (torch): "distlm.family.<folder>.model:<class>"
    description: str  # one line, for model.init.architecture's help
    # the config mapping: config.json (a mapping; the file's name for errors) -> its ModelArgs
    args: Callable[[Mapping[str, Any], str], ModelArgs] = field(repr=False)
    # a seeded init's config.json keys: (model.init, vocabulary size, eos token id) -> a mapping
    init_doc: Callable[[InitSettings, int, int | None], dict[str, Any]] = field(repr=False)
