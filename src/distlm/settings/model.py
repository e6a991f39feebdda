"""`model`: where the base model comes from and how it is serialized."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field

from distlm.settings.base import Real, Section

# The model families distlm supports (distlm.model.family.FAMILIES is keyed by the same names):
# config.json's model_type of a hub or local folder, model.init.architecture of an init.
Architecture = Literal["gpt2", "llama", "qwen2"]
SUPPORTED_MODEL_TYPES: tuple[str, ...] = get_args(Architecture)

# Keys of the Llama family only (GPT-2 has none of them); with architecture gpt2 (the default,
# which is dumped as absent) they are refused when given, so every GPT-2 config dumps, and its
# stages hash, as they did before the Llama family.
LLAMA_KEYS = ("n_kv_head", "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps")


def _dumped_only_when_set(schema: dict[str, Any]) -> None:
    # no default in the generated schema: Snakemake's `validate` would fill it in, and the config
    # would hold a key that ModelInitSettings dumps as absent (tests/test_settings.py)
    schema.pop("default", None)


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


class ModelInitSettings(Section):
    """Architecture of a seeded random init (source init): GPT-2 or the Llama family."""

    architecture: Architecture = Field(
        json_schema_extra=_dumped_only_when_set,
        default="gpt2",
        description=(
            "gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM) or qwen2 (Qwen2ForCausalLM: Llama "
            "with query/key/value biases)."
        ),
    )
    n_layer: int = Field(default=4, ge=1, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, description="Attention heads; must divide n_embd.")
    n_embd: int = Field(default=128, ge=8, description="Width of the residual stream.")
    n_positions: int = Field(default=256, ge=8, description="Context length (positions).")
    dropout: Real = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Residual, embedding and attention dropout (GPT-2); attention dropout (Llama family, "
            "which has no other)."
        ),
    )
    seed: int = Field(
        default=0, ge=0, description="Seed of the initial weights: the same seed, the same bits."
    )
    tie_embeddings: bool | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        description="The LM head is the input embedding; null = true.",
    )
    n_kv_head: int | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        ge=1,
        description=(
            "Llama family: key/value heads (grouped-query attention); must divide n_head; "
            "null = n_head."
        ),
    )
    intermediate_size: int | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        ge=1,
        description="Llama family: width of the gated MLP; null = 4 * n_embd.",
    )
    rope_theta: Real | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        gt=0,
        description="Llama family: rotary base; null = 10000.",
    )
    rope_scaling: RopeScalingSettings | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        description="Llama family: rotary scaling (Llama 3.2's llama3); null = none.",
    )
    rms_norm_eps: Real | None = Field(
        json_schema_extra=_dumped_only_when_set,
        default=None,
        gt=0,
        description="Llama family: RMSNorm epsilon; null = 1e-5.",
    )

    def _dumped(self, out: dict) -> dict:
        # architecture gpt2 and unset keys dump as absent: the mapping (and so the model stage's
        # params and every digest made of them) of a config without them is what it was
        return {
            k: v for k, v in out.items() if not (v is None or (k == "architecture" and v == "gpt2"))
        }


class ModelSourceSettings(Section):
    """Which model: what the data stage reads (a hub or local model brings its tokenizer)."""

    source: Literal["init", "hub", "local"] = Field(
        default="init",
        description=(
            "init (a seeded random model of model.init), hub (a model id in name) or local (a "
            "folder); of a supported type: gpt2, llama, qwen2."
        ),
    )
    name: str | None = Field(
        default=None, description="Hub id (source hub) or model folder (source local)."
    )
    revision: str | None = Field(
        default=None, description="Revision of a hub model; null = latest."
    )


class ModelSettings(ModelSourceSettings):
    """`model`: where the base model comes from and how it is serialized."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="dtype of the serialized weights."
    )
    init: ModelInitSettings = Field(
        default=ModelInitSettings(),
        description="Architecture of a seeded random init (source init).",
    )
