"""`Family`: what one model family knows (build, init, the pipeline cut, the KV-cache shape, the
fused training kernels). The families are `distlm.model.family.gpt2` and `.llama`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from distlm.model.family.blocks import StageBlocks
    from distlm.settings.model import ModelInitSettings


@dataclass(frozen=True)
class Family:
    """One model family, by its checkpoint's tensor names and transformers' classes.

    The pipeline cut: every tensor is an embedding (stage 0), in one decoder layer, or part of
    the final norm and head (the last stage); with tied embeddings the last stage holds its own
    copy of the embedding as `lm_head.weight`."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's `architectures`: the transformers class that loads it
    config_name: str  # the transformers config class
    layers: str  # prefix of decoder layer i's tensors, before "i."
    embeddings: tuple[str, ...]  # prefixes of stage 0's tensors
    final: tuple[str, ...]  # prefixes of the last stage's tensors (final norm, head)
    embedding: str  # the input embedding's weight (what a tied lm_head.weight is)
    kernels: frozenset[str]  # train/kernels.py's fused kernels that apply: "linear_ce", "gelu"

    # -- transformers' classes, imported when first asked for --------------------------------
    @property
    def config_class(self) -> Any:
        import transformers

        return getattr(transformers, self.config_name)

    @property
    def model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.architecture)

    # -- build -------------------------------------------------------------------------------
    def init_config(self, init: ModelInitSettings, vocab_size: int, eos_token_id: int | None):
        """The transformers config of a seeded random init (`model.init`) for this vocabulary."""
        raise NotImplementedError(self.model_type)

    def build(self, config, *, seed: int | None = None):
        """The model of `config` with SDPA attention; seeded random init when `seed` is given."""
        config._attn_implementation = "sdpa"
        if seed is not None:
            torch.manual_seed(seed)
        return self.model_class(config)

    def signature(self, config) -> dict:
        """What must agree between a checkpoint and the model it claims to be (arch_digest)."""
        raise NotImplementedError(self.model_type)

    # -- shapes ------------------------------------------------------------------------------
    def n_layer(self, config) -> int:
        return int(config.num_hidden_layers)

    def n_positions(self, config) -> int:
        """The context: positions the model was built for."""
        return int(config.max_position_embeddings)

    def n_embd(self, config) -> int:
        return int(config.hidden_size)

    def n_head(self, config) -> int:
        return int(config.num_attention_heads)

    def kv_shape(self, config) -> tuple[int, int]:
        """(KV heads, head dim) of one layer's cache: fewer KV heads with grouped-query attention."""
        return self.n_head(config), self.n_embd(config) // self.n_head(config)

    # -- the pipeline cut, by checkpoint tensor name -----------------------------------------
    def tied(self, config) -> dict[str, str]:
        """{"lm_head.weight": the embedding} when the head is the input embedding, else {}."""
        return {"lm_head.weight": self.embedding} if config.tie_word_embeddings else {}

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

    def stage_blocks(
        self, config, start: int, end: int, *, first: bool, last: bool, kernels: str = "standard"
    ) -> StageBlocks:
        """One pipeline stage's weights and math (distlm.model.family.*_blocks), with the
        kernel set of the device it runs on (distlm.device: "cpu" or "standard")."""
        raise NotImplementedError(self.model_type)
