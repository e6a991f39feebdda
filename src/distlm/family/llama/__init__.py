"""The Llama family: Llama (`LlamaForCausalLM`: SmolLM2, TinyLlama, Llama 3.2) and Qwen2
(`Qwen2ForCausalLM`: Llama with biases on the query, key and value projections; Qwen2.5). Rotary
positions (with `rope_scaling` such as Llama 3.2's `llama3`), RMSNorm, a gated SiLU MLP,
grouped-query attention, tied or untied embeddings. Their specs (no torch); the model is
`model.py`, a pipeline stage's math `blocks.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distlm.family.spec import ONLY_WHEN_SET, FamilySpec, InitSettings, TensorNames
from distlm.section import Real, Section

# model.init's defaults of the keys the Llama family has and GPT-2 lacks (config/README.md)
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5


class RopeScalingSettings(Section):
    """Rotary-position scaling as Llama 3.1/3.2 set it (config.json's `rope_scaling`)."""

    rope_type: Literal["llama3"] = Field(
        default="llama3", description="The scaling: llama3 (Llama 3.1 and 3.2)."
    )
    factor: Real = Field(default=32.0, gt=0, description="Scaling factor (Llama 3.2: 32).")
    low_freq_factor: Real = Field(default=1.0, gt=0, description="Llama 3.2: 1.")
    high_freq_factor: Real = Field(default=4.0, gt=0, description="Llama 3.2: 4.")
    original_max_position_embeddings: int = Field(
        default=8192,
        ge=1,
        description="Context of the model before scaling (Llama 3.2: 8192); at most n_positions.",
    )


class LlamaInit(InitSettings):
    """`model.init` of Llama: the keys every family has, and the Llama family's."""

    architecture: Literal["llama"] = Field(
        default="llama", description="llama (LlamaForCausalLM).", **ONLY_WHEN_SET
    )
    n_kv_head: int | None = Field(
        default=None,
        ge=1,
        description="Key/value heads (grouped-query attention); must divide n_head; null = n_head.",
        **ONLY_WHEN_SET,
    )
    intermediate_size: int | None = Field(
        default=None,
        ge=1,
        description="Width of the gated MLP; null = 4 * n_embd.",
        **ONLY_WHEN_SET,
    )
    rope_theta: Real | None = Field(
        default=None, gt=0, description="Rotary base; null = 10000.", **ONLY_WHEN_SET
    )
    rope_scaling: RopeScalingSettings | None = Field(
        default=None,
        description="Rotary scaling (Llama 3.2's llama3); null = none.",
        **ONLY_WHEN_SET,
    )
    rms_norm_eps: Real | None = Field(
        default=None, gt=0, description="RMSNorm epsilon; null = 1e-5.", **ONLY_WHEN_SET
    )

    @property
    def head_width_is(self) -> str:
        """Where the head width comes from, for an error (naming the key to change)."""
        return f"model.init.n_head: head width n_embd / n_head = {self.head_width}"

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            problems.append(
                f"model.init.n_kv_head: model.init.n_head {self.n_head} is not divisible by "
                f"n_kv_head {self.n_kv_head}"
            )
        width = self.head_width
        if width is not None and width % 2:
            problems.append(f"{self.head_width_is} is odd; rotary positions need an even one")
        rs = self.rope_scaling
        if rs is not None and rs.original_max_position_embeddings >= self.n_positions:
            problems.append(
                "model.init.rope_scaling.original_max_position_embeddings: "
                f"{rs.original_max_position_embeddings} must be less than model.init.n_positions "
                f"{self.n_positions} (the scaled context)"
            )
        if rs is not None and rs.high_freq_factor <= rs.low_freq_factor:
            problems.append(
                f"model.init.rope_scaling.high_freq_factor: {rs.high_freq_factor} must be larger "
                f"than low_freq_factor {rs.low_freq_factor}"
            )
        return problems


class Qwen2Init(LlamaInit):
    """`model.init` of Qwen2: Llama's keys (its q, k and v biases come with the architecture)."""

    architecture: Literal["qwen2"] = Field(  # pyright: ignore[reportIncompatibleVariableOverride]
        default="qwen2",
        description="qwen2 (Qwen2ForCausalLM: Llama with query/key/value biases).",
        **ONLY_WHEN_SET,
    )


TENSORS = TensorNames(
    layers="model.layers.",
    embeddings=("model.embed_tokens.",),
    final=("model.norm.", "lm_head."),
    embedding="model.embed_tokens.weight",
)
LLAMA = FamilySpec(
    name="llama",
    architecture="LlamaForCausalLM",
    config_name="LlamaConfig",
    init=LlamaInit,
    tensors=TENSORS,
    model="distlm.family.llama.model:LLAMA_FAMILY",
    description="LlamaForCausalLM: SmolLM2, TinyLlama, Llama 3.2",
)
QWEN2 = FamilySpec(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    config_name="Qwen2Config",
    init=Qwen2Init,
    tensors=TENSORS,
    model="distlm.family.llama.model:QWEN2_FAMILY",
    description="Qwen2ForCausalLM: Llama with query/key/value biases (Qwen2.5)",
)
