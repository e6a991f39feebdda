"""Qwen2 and Qwen3, variants of the Llama family: Llama's decoder, blocks and tensors, with
Qwen's config defaults and sliding-window keys, and

- Qwen2 (`Qwen2ForCausalLM`: Qwen2, Qwen2.5): biases on the query, key and value projections,
  always;
- Qwen3 (`Qwen3ForCausalLM`: Qwen3-0.6B and up): RMSNorm on each head's queries and keys before
  the rotary positions, and a head width (`head_dim`) of its own, not
  `hidden_size / num_attention_heads`.

Where a family lives (distlm.family's rule): a family whose blocks are its own is a folder; a
family that runs another's blocks, and differs in config keys, defaults, biases or norms those
blocks already know, is a variant in that folder, as these two are Llama's. Their specs and
config mappings (no torch); their model is `distlm.family.llama.model`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from distlm.family.llama import MODEL, TENSORS, LlamaArgs, LlamaInit, llama_args, llama_init_doc
from distlm.family.spec import ONLY_WHEN_SET, FamilySpec


class Qwen2Init(LlamaInit):
    """`model.init` of Qwen2: Llama's keys (its q, k and v biases come with the architecture)."""

    architecture: Literal["qwen2"] = Field(  # pyright: ignore[reportIncompatibleVariableOverride]
        default="qwen2",
        description="qwen2 (Qwen2ForCausalLM: Llama with query/key/value biases).",
        **ONLY_WHEN_SET,
    )


class Qwen3Init(LlamaInit):
    """`model.init` of Qwen3: Llama's keys and `head_dim`."""

    architecture: Literal["qwen3"] = Field(  # pyright: ignore[reportIncompatibleVariableOverride]
        default="qwen3",
        description="qwen3 (Qwen3ForCausalLM: query/key RMSNorm, a head width of its own).",
        **ONLY_WHEN_SET,
    )
    head_dim: int | None = Field(
        default=None,
        ge=2,
        description="Width of each attention head; null = n_embd / n_head (Qwen3-0.6B: 128).",
        **ONLY_WHEN_SET,
    )

    @property
    def head_width(self) -> int | None:
        # with head_dim, n_head need not divide n_embd: q_proj maps n_embd to n_head x head_dim
        return self.head_dim if self.head_dim is not None else super().head_width

    @property
    def head_width_is(self) -> str:
        if self.head_dim is None:
            return super().head_width_is
        return f"model.init.head_dim: {self.head_dim}"


# Qwen2Config's and Qwen3Config's defaults where LlamaConfig's differ
QWEN_DEFAULTS = {
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "max_position_embeddings": 32768,
}


def qwen2_args(doc: Mapping[str, Any], where: str) -> LlamaArgs:
    """config.json of Qwen2 -> LlamaArgs: q, k and v always have biases."""
    return llama_args(doc, where, model_type="qwen2", defaults=QWEN_DEFAULTS, qkv_bias=True)


def qwen3_args(doc: Mapping[str, Any], where: str) -> LlamaArgs:
    """config.json of Qwen3 -> its LlamaArgs: query/key norm, Qwen3Config's head width of 128 when
    the config names none, biases as attention_bias says."""
    return llama_args(
        doc, where, model_type="qwen3", defaults={**QWEN_DEFAULTS, "head_dim": 128}, qk_norm=True
    )


def qwen3_init_doc(init: Qwen3Init, vocab_size: int, eos_token_id: int | None) -> dict:
    """config.json's keys of a seeded init: the Llama family's, Qwen3's head width, no biases."""
    head_dim = init.head_dim or init.n_embd // init.n_head
    return {
        **llama_init_doc(init, vocab_size, eos_token_id),
        "head_dim": head_dim,
        "attention_bias": False,
    }


QWEN2 = FamilySpec(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    config_name="Qwen2Config",
    init=Qwen2Init,
    tensors=TENSORS,
    model=MODEL,
    description="Qwen2ForCausalLM: Llama with query/key/value biases (Qwen2.5)",
    args=qwen2_args,
    init_doc=llama_init_doc,  # pyright: ignore[reportArgumentType] (its init settings')
)
QWEN3 = FamilySpec(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    config_name="Qwen3Config",
    init=Qwen3Init,
    tensors=TENSORS,
    model=MODEL,
    description="Qwen3ForCausalLM: query/key RMSNorm, its own head width (Qwen3-0.6B)",
    args=qwen3_args,
    init_doc=qwen3_init_doc,  # pyright: ignore[reportArgumentType] (its init settings')
)
