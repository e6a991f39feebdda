"""`Family`: one model family with torch: distlm's model of it (`distlm.family.transformer`),
built from its `ModelArgs`, and transformers' classes for the model stage's side (a seeded init,
config.json). `distlm.family.family_of` makes one from a config, its args or a model_type: its
spec and the model class the spec names (`distlm/family/<folder>/model.py`).

    fam = family_of(args)                    # or family_of("llama")
    model = fam.build(args, device=dev)      # distlm's model; its weights come from load_hf
    stage = fam.build(args, Cut(4, 8, first=False, last=True))        # a pipeline stage
    config = fam.init_config(init, vocab_size, eos_token_id)          # model.init's config.json
"""

from __future__ import annotations

from typing import Any

import torch

from distlm.family.spec import FamilySpec, InitSettings, ModelArgs
from distlm.family.table import Cut, TensorTable
from distlm.family.transformer import Transformer


class Family:
    """One model family's model (see the module doc); its spec says what it is without torch."""

    def __init__(self, spec: FamilySpec, model: type[Transformer]) -> None:
        self.spec = spec
        self.model = model

    @property
    def model_type(self) -> str:
        return self.spec.name

    @property
    def architecture(self) -> str:
        return self.spec.architecture

    @property
    def tensors(self) -> TensorTable:
        return self.spec.tensors

    def args(self, doc: dict[str, Any], where: str) -> ModelArgs:
        """config.json (a dict) -> the args distlm's model is built from (the family's mapping)."""
        return self.spec.args(doc, where)

    # -- distlm's model ----------------------------------------------------------------------
    def build(
        self,
        args: ModelArgs,
        cut: Cut | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Transformer:
        """distlm's model of `args` (or what `cut` holds of it: a pipeline stage) on `device` (`meta` for its shapes alone), its parameters allocated but
        not set: load them (`Transformer.load_hf`) or receive them. Nothing is initialised that
        would then be overwritten."""
        with torch.device(device):
            model = self.model(args, cut)
        return model if dtype == torch.float32 else model.to(dtype)

    def tied(self, args: ModelArgs) -> dict[str, str]:
        """{"lm_head.weight": the embedding} when the head is the input embedding, else {}:
        transformers' names of what a folder omits."""
        t = self.tensors
        return {t.head: t.embedding} if args.tied else {}

    # -- transformers' classes: the model stage's side (config.json, a seeded init) ---------
    @property
    def config_class(self) -> Any:
        import transformers

        return getattr(transformers, self.spec.config_name)

    @property
    def hf_model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.spec.architecture)

    def init_config(self, init: InitSettings, vocab_size: int, eos_token_id: int | None):
        """The transformers config of a seeded random init (`model.init`) for this vocabulary:
        the family's config.json keys of it (`FamilySpec.init_doc`), in its config class."""
        doc = dict(self.spec.init_doc(init, vocab_size, eos_token_id))
        doc.pop("model_type")
        return self.config_class(**doc)

    def init_model(self, config, *, seed: int):
        """transformers' model of `config`, seeded: the model stage's random init (the same
        seed, the same bits, as every release of distlm has made it)."""
        torch.manual_seed(seed)
        return self.hf_model_class(config)
