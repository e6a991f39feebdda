"""Models of a supported family (`distlm.family`): build, load,
serialize, and split into pipeline-stage shards.

A *model folder* (written by the model stage and by training's final checkpoint) holds:
    model.safetensors        the state dict in transformers' names (tied lm_head.weight omitted,
                             as Hugging Face does)
    config.json              the transformers config (its model_type names the family)
    tokenizer files          the tokenizer the token blocks were made with
    distlm.json              provenance (a `ModelMeta` document): source, config digest, and the
                             sha256 of model.safetensors that `verify_model_folder` checks
    generation_config.json   what `save_pretrained` writes beside config.json (bos/eos token ids)
It is what the family's transformers class (`GPT2LMHeadModel`, `LlamaForCausalLM`, ...) writes
with `save_pretrained` (config.json names `architectures`, the tokenizer files carry their
special tokens), so `AutoModelForCausalLM.from_pretrained(folder)`, `transformers serve` and vLLM
load it as it is; distlm's stages load it into distlm's own model of the family
(`load_model_dir`, `read_args`: distlm.family), never into transformers'.

A *pipeline folder* (rule shard, `write_pipeline_dir`) is a model folder cut for S pipeline
stages: config.json, the tokenizer, distlm.json (the source folder and its sha256) and
    shards/manifest.json     S pipeline stages: layer ranges, tensor names, bytes, sha256 per shard
    shards/stage-XX.safetensors

The package, by part (what each model family knows is `distlm.family`): `layout` (file names, formats), `source` (the model stage's side: config, seeded init, hub or local source, through transformers),
`folder` (model folders: write, load, verify), `shards` (pipeline folders: plan, write, load),
`stage` (the model stage: `serialize`), `weights` (a folder's weights as a running server takes
them: which file holds which tensor, each file's sha256, one stage's tensors read; imported as
`distlm.model.weights`). Import the rest from `distlm.model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distlm.core.lazy import lazy_names

if TYPE_CHECKING:
    from distlm.family import SUPPORTED, family_of
    from distlm.family.builder import Family
    from distlm.family.transformer import Transformer, check_tensors
    from distlm.model.folder import (
        load_model_dir,
        load_safetensors,
        read_args,
        read_config,
        read_meta,
        save_config,
        save_safetensors,
        verify_model_folder,
        write_model_dir,
    )
    from distlm.model.layout import (
        CONFIG,
        DTYPES,
        MANIFEST,
        META,
        MODEL_FORMAT,
        PIPELINE_FORMAT,
        SHARDS,
        SHARDS_FORMAT,
        WEIGHTS,
    )
    from distlm.model.shards import (
        StagePlan,
        load_shards,
        load_stage_shard,
        plan_stages,
        read_manifest,
        write_pipeline_dir,
    )
    from distlm.model.source import init_config, init_model, load_source, state_dict_for_save
    from distlm.model.stage import serialize

# Imported when first asked for (PEP 562), so that a light module of this package (its documents)
# can be imported without the rest: the report and distlm-launch read documents, and must not
# import torch for them.
_WHERE = {
    "CONFIG": "distlm.model.layout",
    "DTYPES": "distlm.model.layout",
    "MANIFEST": "distlm.model.layout",
    "META": "distlm.model.layout",
    "MODEL_FORMAT": "distlm.model.layout",
    "PIPELINE_FORMAT": "distlm.model.layout",
    "SHARDS": "distlm.model.layout",
    "SHARDS_FORMAT": "distlm.model.layout",
    "SUPPORTED": "distlm.family",
    "WEIGHTS": "distlm.model.layout",
    "Family": "distlm.family.builder",
    "StagePlan": "distlm.model.shards",
    "Transformer": "distlm.family.transformer",
    "check_tensors": "distlm.family.transformer",
    "family_of": "distlm.family",
    "init_config": "distlm.model.source",
    "init_model": "distlm.model.source",
    "load_model_dir": "distlm.model.folder",
    "load_safetensors": "distlm.model.folder",
    "load_shards": "distlm.model.shards",
    "load_source": "distlm.model.source",
    "load_stage_shard": "distlm.model.shards",
    "plan_stages": "distlm.model.shards",
    "read_args": "distlm.model.folder",
    "read_config": "distlm.model.folder",
    "read_manifest": "distlm.model.shards",
    "read_meta": "distlm.model.folder",
    "save_config": "distlm.model.folder",
    "save_safetensors": "distlm.model.folder",
    "serialize": "distlm.model.stage",
    "state_dict_for_save": "distlm.model.source",
    "verify_model_folder": "distlm.model.folder",
    "write_model_dir": "distlm.model.folder",
    "write_pipeline_dir": "distlm.model.shards",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = [
    "CONFIG",
    "DTYPES",
    "MANIFEST",
    "META",
    "MODEL_FORMAT",
    "PIPELINE_FORMAT",
    "SHARDS",
    "SHARDS_FORMAT",
    "SUPPORTED",
    "WEIGHTS",
    "Family",
    "StagePlan",
    "Transformer",
    "check_tensors",
    "family_of",
    "init_config",
    "init_model",
    "load_model_dir",
    "load_safetensors",
    "load_shards",
    "load_source",
    "load_stage_shard",
    "plan_stages",
    "read_args",
    "read_config",
    "read_manifest",
    "read_meta",
    "save_config",
    "save_safetensors",
    "serialize",
    "state_dict_for_save",
    "verify_model_folder",
    "write_model_dir",
    "write_pipeline_dir",
]
