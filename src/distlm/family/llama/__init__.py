"""The Llama family (`LlamaForCausalLM`: SmolLM2, TinyLlama, Llama 3.2): rotary positions (with
`rope_scaling` such as Llama 3.2's `llama3`), RMSNorm, a gated SiLU MLP, grouped-query attention,
tied or untied embeddings. Its spec, config mapping and tensor table (no torch); its variants
Qwen2 and Qwen3 are `qwen.py`; their blocks are `blocks.py`, their model `model.py`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from distlm import DistlmError
from distlm.core.section import Real, Section
from distlm.family.spec import (
    ACTIVATIONS,
    ONLY_WHEN_SET,
    ConfigDoc,
    FamilySpec,
    InitSettings,
    ModelArgs,
)
from distlm.family.table import LM_HEAD, TensorTable, embedding, linear, norm

# the model every family of this folder runs (its blocks know each variant's biases and norms)
MODEL = "distlm.family.llama.model:LlamaModel"

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


# ----------------------------------------------------------------------------- config mapping

# rotary scalings distlm's blocks compute (transformers' ROPE_INIT_FUNCTIONS of the same names)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# rope types whose frequencies depend on the sequence's length (transformers' dynamic_rope_update):
# sequences of different lengths share a micro-batch, so one set of frequencies cannot serve them
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True, kw_only=True)
class RopeArgs:
    """Rotary positions as config.json's `rope_parameters` (or the older `rope_theta` and
    `rope_scaling`) set them: the inverse frequencies' base and scaling (distlm.family.llama.
    blocks: `inverse_frequencies`)."""

    kind: str = "default"  # rope_type: default, linear, llama3, yarn
    theta: float = ROPE_THETA  # rope_theta
    factor: float = 1.0  # linear, llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_context: int = 0  # original_max_position_embeddings (llama3, yarn)
    attention_factor: float | None = None  # yarn: cos and sin scaled by it (None: from factor)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn


def _qk_norm(a: LlamaArgs) -> bool:
    return a.qk_norm


def _width(a: LlamaArgs) -> int:
    return a.dim


def _qkv(a: LlamaArgs) -> tuple[int, int, int]:
    return (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim)


_L = "model.layers.{i}."  # transformers' decoder layer i
_A = _L + "self_attn."
# the Llama family's parameters in its model's order (Qwen2's and Qwen3's too: their args say
# which biases and norms a model has); q|k|v and gate|up are each one of distlm's projections,
# transformers' projections concatenated ("cat")
TENSORS = TensorTable(
    (
        embedding("embedding.weight", "model.embed_tokens.weight", lambda a: a.vocab_size),
        norm("layers.{i}.attn_norm", _L + "input_layernorm", _width),
        linear(
            "layers.{i}.attn.qkv",
            tuple(f"{_A}{x}_proj" for x in "qkv"),
            lambda a: sum(_qkv(a)),
            _width,
            bias=lambda a: a.qkv_bias,
            kind="cat",
            sizes=_qkv,
        ),
        linear(
            "layers.{i}.attn.o",
            _A + "o_proj",
            _width,
            lambda a: a.n_heads * a.head_dim,
            bias=lambda a: a.o_bias,
        ),
        norm("layers.{i}.attn.q_norm", _A + "q_norm", lambda a: a.head_dim, when=_qk_norm),
        norm("layers.{i}.attn.k_norm", _A + "k_norm", lambda a: a.head_dim, when=_qk_norm),
        norm("layers.{i}.mlp_norm", _L + "post_attention_layernorm", _width),
        linear(
            "layers.{i}.mlp.gate_up",
            (_L + "mlp.gate_proj", _L + "mlp.up_proj"),
            lambda a: 2 * a.mlp_dim,
            _width,
            bias=lambda a: a.mlp_bias,
            kind="cat",
            sizes=lambda a: (a.mlp_dim, a.mlp_dim),
        ),
        linear(
            "layers.{i}.mlp.down",
            _L + "mlp.down_proj",
            _width,
            lambda a: a.mlp_dim,
            bias=lambda a: a.mlp_bias,
        ),
        norm("norm", "model.norm", _width),
        LM_HEAD,
    ),
    embedding="embedding.weight",
)


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(ModelArgs):
    """The Llama family's architecture: ModelArgs, rotary positions, which projections have
    biases, and Qwen3's query/key norm."""

    TABLE: ClassVar[TensorTable] = TENSORS

    rope: RopeArgs
    qkv_bias: bool = False  # q, k and v projections (Qwen2's always; attention_bias elsewhere)
    o_bias: bool = False  # the output projection (attention_bias)
    mlp_bias: bool = False  # gate, up and down projections (mlp_bias)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys before rotary (Qwen3)

    def signature(self) -> dict[str, Any]:
        sig = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.context,
            "hidden_size": self.dim,
            "intermediate_size": self.mlp_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "tie_word_embeddings": self.tied,
        }
        if self.qk_norm:  # Qwen3's head width is a key of its own
            sig["head_dim"] = self.head_dim
        return sig


def rope_args(c: ConfigDoc, context: int) -> RopeArgs:
    """config.json's rotary settings, as transformers standardises them: `rope_scaling` (older
    configs) over `rope_parameters`; rope_theta inside them, else beside them, else 10000."""
    raw = c.get("rope_scaling", "rope_parameters", default={})
    key = "rope_scaling" if c.get("rope_scaling") is not None else "rope_parameters"
    if not isinstance(raw, Mapping) or any(isinstance(v, Mapping) for v in raw.values()):
        raise c.bad(key, "one set of rotary parameters for every layer")
    r = ConfigDoc(raw, f"{c.where} {key}")
    kind = r.get("rope_type", "type", default="default")
    if kind in _LENGTH_DEPENDENT_ROPE:
        raise DistlmError(
            f"{c.where}: {key}.rope_type {kind!r}: its frequencies depend on the sequence's "
            "length, which the sequences of a micro-batch do not share; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    kind = r.choice("rope_type" if "rope_type" in raw else "type", "default", ROPE_TYPES)
    partial = r.get("partial_rotary_factor", default=c.get("partial_rotary_factor", default=1.0))
    if partial != 1:
        raise DistlmError(
            f"{c.where}: partial_rotary_factor {partial!r}: distlm rotates the whole head"
        )
    theta = r.number("rope_theta", default=c.number("rope_theta", default=ROPE_THETA), least=1e-9)
    if kind == "default":
        return RopeArgs(theta=theta)
    original = c.get("original_max_position_embeddings") or r.integer(
        "original_max_position_embeddings", default=context
    )
    if kind == "llama3":
        return RopeArgs(
            kind=kind,
            theta=theta,
            factor=r.number("factor", least=1e-9),
            low_freq_factor=r.number("low_freq_factor", least=1e-9),
            high_freq_factor=r.number("high_freq_factor", least=1e-9),
            original_context=original,
        )
    if kind == "linear":
        return RopeArgs(kind=kind, theta=theta, factor=r.number("factor", least=1e-9))
    optional = {k: r.number(k) if r.get(k) is not None else None for k in ("attention_factor",)}
    return RopeArgs(  # yarn
        kind=kind,
        theta=theta,
        factor=r.number("factor", default=context / original, least=1e-9),
        original_context=original,
        attention_factor=optional["attention_factor"],
        mscale=r.number("mscale") if r.get("mscale") is not None else None,
        mscale_all_dim=r.number("mscale_all_dim") if r.get("mscale_all_dim") is not None else None,
        beta_fast=r.number("beta_fast", default=32.0),
        beta_slow=r.number("beta_slow", default=1.0),
        truncate=r.flag("truncate", True),
    )


def check_full_attention(c: ConfigDoc, n_layers: int) -> None:
    """Refuse sliding-window layers (Qwen's `layer_types`, or `use_sliding_window` from
    max_window_layers on): distlm's blocks attend over every position."""
    types = c.get("layer_types")
    if types is None:
        window = c.flag("use_sliding_window", False) and c.get("sliding_window", default=4096)
        first = c.integer("max_window_layers", default=28, least=0)
        types = ["sliding" if window and i >= first else "full_attention" for i in range(n_layers)]
    sliding = [i for i, t in enumerate(types) if t != "full_attention"]
    if sliding:
        raise DistlmError(
            f"{c.where}: layer_types: layers {sliding} use sliding-window attention, which "
            "distlm's model does not run; set use_sliding_window to false"
        )


def llama_args(
    doc: Mapping[str, Any],
    where: str,
    *,
    model_type: str = "llama",
    defaults: Mapping[str, Any] | None = None,
    qkv_bias: bool | None = None,
    qk_norm: bool = False,
) -> LlamaArgs:
    """config.json of the Llama family -> LlamaArgs, with the family's config class's defaults
    for absent keys (`defaults`: Qwen's, where they differ from LlamaConfig's). `qkv_bias`: the
    architecture's (Qwen2: always), else attention_bias."""
    c = ConfigDoc(doc, where)
    d = {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "head_dim": None,
        **(defaults or {}),
    }
    dim, heads = (
        c.integer("hidden_size", default=d["hidden_size"]),
        c.integer("num_attention_heads", default=d["num_attention_heads"]),
    )
    head_dim = c.integer("head_dim", default=d["head_dim"] or dim // heads)
    if c.get("head_dim", default=d["head_dim"]) is None and dim % heads:
        raise c.bad("hidden_size", f"a multiple of num_attention_heads ({heads})")
    kv = c.integer("num_key_value_heads", default=heads)
    if heads % kv:
        raise c.bad("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    if head_dim % 2:
        raise c.bad("head_dim", "an even head width (rotary positions rotate pairs)")
    n_layers = c.integer("num_hidden_layers", default=d["num_hidden_layers"])
    context = c.integer("max_position_embeddings", default=d["max_position_embeddings"])
    if model_type != "llama":
        check_full_attention(c, n_layers)
    attention_bias = c.flag("attention_bias", False)
    return LlamaArgs(
        model_type=model_type,
        vocab_size=c.integer("vocab_size", default=d["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim,
        context=context,
        mlp_dim=c.integer("intermediate_size", default=d["intermediate_size"]),
        norm_eps=c.number("rms_norm_eps", default=1e-6),
        act=c.choice("hidden_act", "silu", tuple(ACTIVATIONS)),
        tied=c.flag("tie_word_embeddings", d["tie_word_embeddings"]),
        attn_dropout=c.number("attention_dropout", default=0.0),
        rope=rope_args(c, context),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias,
        mlp_bias=c.flag("mlp_bias", False),
        qk_norm=qk_norm,
    )


def llama_init_doc(init: LlamaInit, vocab_size: int, eos_token_id: int | None) -> dict:
    """config.json's keys of a seeded init (`model.init`) for this vocabulary."""
    rope: dict = {
        "rope_type": "default",
        "rope_theta": init.rope_theta if init.rope_theta is not None else ROPE_THETA,
    }
    if init.rope_scaling is not None:
        rope.update(init.rope_scaling.model_dump())
    doc = {
        "model_type": init.architecture,
        "vocab_size": vocab_size,
        "hidden_size": init.n_embd,
        "intermediate_size": init.intermediate_size or 4 * init.n_embd,
        "num_hidden_layers": init.n_layer,
        "num_attention_heads": init.n_head,
        "num_key_value_heads": init.n_kv_head or init.n_head,
        "max_position_embeddings": init.n_positions,
        "rms_norm_eps": init.rms_norm_eps if init.rms_norm_eps is not None else RMS_NORM_EPS,
        "rope_parameters": rope,
        "tie_word_embeddings": init.tie_embeddings if init.tie_embeddings is not None else True,
        "attention_dropout": init.dropout,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }
    if init.architecture != "llama":  # Qwen's: every layer attends over every position
        doc["use_sliding_window"] = False
    return doc


LLAMA = FamilySpec(
    name="llama",
    architecture="LlamaForCausalLM",
    config_name="LlamaConfig",
    init=LlamaInit,
    tensors=TENSORS,
    model=MODEL,
    description="LlamaForCausalLM: SmolLM2, TinyLlama, Llama 3.2",
    args=llama_args,
    init_doc=llama_init_doc,  # pyright: ignore[reportArgumentType] (its init settings')
)
