"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, a GELU MLP, tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

from distlm.model.family.base import Family


@dataclass(frozen=True)
class GPT2Family(Family):
    def init_config(self, init, vocab_size, eos_token_id):
        return self.config_class(
            vocab_size=vocab_size,
            n_positions=init.n_positions,
            n_embd=init.n_embd,
            n_layer=init.n_layer,
            n_head=init.n_head,
            resid_pdrop=init.dropout,
            embd_pdrop=init.dropout,
            attn_pdrop=init.dropout,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=init.tie_embeddings is not False,  # null = tied
        )

    def signature(self, config) -> dict:
        return {
            k: getattr(config, k)
            for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
        }

    def stage_blocks(self, config, start, end, *, first, last, kernels="standard"):
        from distlm.model.family.gpt2_blocks import GPT2Blocks

        return GPT2Blocks(config, start, end, first=first, last=last, kernels=kernels)


GPT2 = GPT2Family(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
    config_name="GPT2Config",
    layers="transformer.h.",
    embeddings=("transformer.wte.", "transformer.wpe."),
    final=("transformer.ln_f.", "lm_head."),
    embedding="transformer.wte.weight",
    kernels=frozenset({"linear_ce", "gelu"}),
)
