"""What a model family is, without torch: its name, transformers' classes, its `model.init`
settings as a typed model, and its checkpoint's tensor names (the pipeline cut).

The registry (`distlm.family.REGISTRY`) holds one `FamilySpec` a family; each family's folder
(`distlm/family/<name>/`) holds its spec (`__init__.py`, read by the settings while the workflow
builds the DAG) and, with torch, its model (`model.py`: build, init, the `logits` hook, its
training pieces) and its pipeline stage's math (`blocks.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from distlm.section import Real, Section


def _dumped_only_when_set(schema: dict[str, Any]) -> None:
    # no default in the generated schema: the workflow's config would hold a key that the init
    # settings dump as absent (tests/test_settings.py)
    schema.pop("default", None)


ONLY_WHEN_SET: dict[str, Any] = {"json_schema_extra": _dumped_only_when_set}


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


@dataclass(frozen=True)
class TensorNames:
    """A checkpoint's tensors by name: which belong to stage 0, to decoder layer i, to the last
    stage (the pipeline cut), and what a tied LM head is."""

    layers: str  # prefix of decoder layer i's tensors, before "i."
    embeddings: tuple[str, ...]  # prefixes of stage 0's tensors
    final: tuple[str, ...]  # prefixes of the last stage's tensors (final norm, head)
    embedding: str  # the input embedding's weight (what a tied lm_head.weight is)
    head: str = "lm_head.weight"

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a tensor belongs to; None for embeddings, final norm and head."""
        if not name.startswith(self.layers):
            return None
        index = name[len(self.layers) :].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def is_first(self, name: str) -> bool:
        """An embedding tensor: held by stage 0."""
        return name.startswith(self.embeddings)

    def is_last(self, name: str) -> bool:
        """Final norm or LM head: held by the last stage."""
        return name.startswith(self.final)


@dataclass(frozen=True)
class FamilySpec:
    """One model family, registered once (distlm.family.REGISTRY)."""

    name: str  # config.json's model_type, and model.init.architecture
    architecture: str  # config.json's `architectures`: the transformers class that loads it
    config_name: str  # the transformers config class
    init: type[InitSettings]  # its model.init settings
    tensors: TensorNames
    model: str  # where its model (torch) is: "distlm.family.<folder>.model:<name>"
    description: str  # one line, for model.init.architecture's help
