"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, a GELU MLP, tied embeddings. Its spec
(no torch); the model is `model.py`, a pipeline stage's math `blocks.py`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from distlm.family.spec import ONLY_WHEN_SET, FamilySpec, InitSettings, TensorNames


class GPT2Init(InitSettings):
    """`model.init` of GPT-2: the keys every family has."""

    architecture: Literal["gpt2"] = Field(
        default="gpt2", description="gpt2 (GPT2LMHeadModel).", **ONLY_WHEN_SET
    )
    DUMPS_ARCHITECTURE: ClassVar[bool] = False  # the default family: a config need not name it


GPT2 = FamilySpec(
    name="gpt2",
    architecture="GPT2LMHeadModel",
    config_name="GPT2Config",
    init=GPT2Init,
    tensors=TensorNames(
        layers="transformer.h.",
        embeddings=("transformer.wte.", "transformer.wpe."),
        final=("transformer.ln_f.", "lm_head."),
        embedding="transformer.wte.weight",
    ),
    model="distlm.family.gpt2.model:FAMILY",
    description="GPT2LMHeadModel",
)
