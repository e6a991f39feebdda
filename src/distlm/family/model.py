"""`Family`: what one model family's model is, with torch: build and seeded init, its shapes, the
KV cache's, the pipeline stage's blocks, the `logits` hook and its training pieces. Each family's
folder subclasses it (`distlm/family/<name>/model.py`, its `FAMILY`); `distlm.family.family_of`
finds it from a config or a model_type.

The logits hook is the one place that says how a family's hidden states become logits: training
(`distlm.train.kernels`), evaluation and the pipeline engine (the family's blocks) all call it. A
family whose logits are not the plain LM head of the hidden states (soft-capping, a scale) says so
in `logits` and `linear_logits`, and training then never takes the fused linear cross-entropy,
which computes `hidden @ lm_head.weight.T` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from distlm.family.spec import FamilySpec, InitSettings, TensorNames

if TYPE_CHECKING:
    from distlm.family.blocks import StageBlocks


class Family:
    """One model family's model (see the module doc); its spec says what it is without torch."""

    linear_logits: bool = True  # logits = hidden @ lm_head.weight.T (the fused head applies)

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec

    @property
    def model_type(self) -> str:
        return self.spec.name

    @property
    def architecture(self) -> str:
        return self.spec.architecture

    @property
    def tensors(self) -> TensorNames:
        return self.spec.tensors

    # -- transformers' classes, imported when first asked for --------------------------------
    @property
    def config_class(self) -> Any:
        import transformers

        return getattr(transformers, self.spec.config_name)

    @property
    def model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.spec.architecture)

    # -- build -------------------------------------------------------------------------------
    def init_config(self, init: InitSettings, vocab_size: int, eos_token_id: int | None):
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

    def tied(self, config) -> dict[str, str]:
        """{"lm_head.weight": the embedding} when the head is the input embedding, else {}."""
        t = self.tensors
        return {t.head: t.embedding} if config.tie_word_embeddings else {}

    # -- the logits hook and the training pieces ---------------------------------------------
    def logits(self, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (..., C) -> (..., V): the LM head, for most families."""
        return lm_head(hidden)

    def decoder(self, model) -> torch.nn.Module:
        """The model without its LM head: input ids -> final hidden states (normed)."""
        return model.base_model

    def prepare_training(self, model, kernels: str) -> str:
        """Swap in the family's training kernels for the device's kernel set (distlm.device:
        "cpu" or "standard"); modules that hold no weights only, so the model saved is the same.
        Returns what it did, for the log ("" for nothing)."""
        return ""

    # -- the pipeline engine -----------------------------------------------------------------
    def blocks_class(self) -> Callable[..., StageBlocks]:
        """The family's pipeline stage (its blocks.py), imported when first asked for."""
        raise NotImplementedError(self.model_type)

    def stage_blocks(
        self, config, start: int, end: int, *, first: bool, last: bool, kernels: str = "standard"
    ) -> StageBlocks:
        """One pipeline stage's weights and math (the family's blocks.py), with the kernel set
        of the device it runs on (distlm.device: "cpu" or "standard") and the logits hook."""
        blocks = self.blocks_class()(config, start, end, first=first, last=last, kernels=kernels)
        blocks.logits = self.logits
        return blocks
