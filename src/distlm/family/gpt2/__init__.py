"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, a GELU MLP, tied embeddings. Its spec
and config mapping (no torch); its blocks are `blocks.py`, its model and tensor names `model.py`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from distlm.family.spec import (
    ACTIVATIONS,
    ONLY_WHEN_SET,
    ConfigDoc,
    FamilySpec,
    InitSettings,
    ModelArgs,
)
from distlm.family.table import LM_HEAD, TensorTable, embedding, linear, norm


class GPT2Init(InitSettings):
    """`model.init` of GPT-2: the keys every family has."""

    architecture: Literal["gpt2"] = Field(
        default="gpt2", description="gpt2 (GPT2LMHeadModel).", **ONLY_WHEN_SET
    )
    DUMPS_ARCHITECTURE: ClassVar[bool] = False  # the default family: a config need not name it


def _width(a: GPT2Args) -> int:
    return a.dim


_H = "transformer.h.{i}."  # transformers' decoder layer i
# GPT-2's parameters in its model's order; transformers' Conv1D layers hold each linear layer's
# weight transposed ("t")
TENSORS = TensorTable(
    (
        embedding("embedding.wte.weight", "transformer.wte.weight", lambda a: a.vocab_size),
        embedding("embedding.wpe.weight", "transformer.wpe.weight", lambda a: a.context),
        norm("layers.{i}.ln_1", _H + "ln_1", _width, bias=True),
        linear("layers.{i}.attn.qkv", _H + "attn.c_attn", lambda a: 3 * a.dim, _width, kind="t"),
        linear("layers.{i}.attn.proj", _H + "attn.c_proj", _width, _width, kind="t"),
        norm("layers.{i}.ln_2", _H + "ln_2", _width, bias=True),
        linear("layers.{i}.mlp.fc", _H + "mlp.c_fc", lambda a: a.mlp_dim, _width, kind="t"),
        linear("layers.{i}.mlp.proj", _H + "mlp.c_proj", _width, lambda a: a.mlp_dim, kind="t"),
        norm("norm", "transformer.ln_f", _width, bias=True),
        LM_HEAD,
    ),
    embedding="embedding.wte.weight",
)


@dataclass(frozen=True, kw_only=True)
class GPT2Args(ModelArgs):
    """GPT-2's architecture: ModelArgs and its dropouts and attention scales."""

    TABLE: ClassVar[TensorTable] = TENSORS

    resid_dropout: float = 0.0  # after each block's attention and MLP (resid_pdrop)
    embd_dropout: float = 0.0  # after the embeddings (embd_pdrop)
    scale_attn_weights: bool = True  # scores scaled by 1 / sqrt(head_dim)
    scale_by_layer: bool = False  # and by 1 / (layer + 1) (scale_attn_by_inverse_layer_idx)

    def attn_scale(self, layer: int) -> float:
        """SDPA's scale of decoder layer `layer` (GPT2Attention.scaling)."""
        s = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        return s / (layer + 1) if self.scale_by_layer else s

    def signature(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "n_positions": self.context,
            "n_embd": self.dim,
            "n_layer": self.n_layers,
            "n_head": self.n_heads,
        }


def gpt2_args(doc: Mapping[str, Any], where: str) -> GPT2Args:
    """config.json of GPT-2 -> GPT2Args (GPT2Config's defaults for absent keys)."""
    c = ConfigDoc(doc, where)
    dim, heads = c.integer("n_embd", default=768), c.integer("n_head", default=12)
    if dim % heads:
        raise c.bad("n_embd", f"a multiple of n_head ({heads})")
    if c.flag("add_cross_attention", False):
        raise c.bad("add_cross_attention", "false (distlm's GPT-2 is a decoder alone)")
    return GPT2Args(
        model_type="gpt2",
        vocab_size=c.integer("vocab_size", default=50257),
        dim=dim,
        n_layers=c.integer("n_layer", default=12),
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=dim // heads,
        context=c.integer("n_positions", default=1024),
        mlp_dim=c.integer("n_inner", default=4 * dim),
        norm_eps=c.number("layer_norm_epsilon", default=1e-5),
        act=c.choice("activation_function", "gelu_new", tuple(ACTIVATIONS)),
        tied=c.flag("tie_word_embeddings", True),
        attn_dropout=c.number("attn_pdrop", default=0.1),
        resid_dropout=c.number("resid_pdrop", default=0.1),
        embd_dropout=c.number("embd_pdrop", default=0.1),
        scale_attn_weights=c.flag("scale_attn_weights", True),
        scale_by_layer=c.flag("scale_attn_by_inverse_layer_idx", False),
    )


def gpt2_init_doc(init: InitSettings, vocab_size: int, eos_token_id: int | None) -> dict:
    """config.json's keys of a seeded init (`model.init`) for this vocabulary (GPT2Config's)."""
    return {
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": init.n_positions,
        "n_embd": init.n_embd,
        "n_layer": init.n_layer,
        "n_head": init.n_head,
        "resid_pdrop": init.dropout,
        "embd_pdrop": init.dropout,
        "attn_pdrop": init.dropout,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": init.tie_embeddings is not False,  # null = tied
    }


GPT2 = FamilySpec(
    name="gpt2",
    architecture="GPT2LMHeadModel",
    config_name="GPT2Config",
    init=GPT2Init,
    tensors=TENSORS,
    model="distlm.family.gpt2.model:GPT2Model",
    description="GPT2LMHeadModel",
    args=gpt2_args,
    init_doc=gpt2_init_doc,
)
