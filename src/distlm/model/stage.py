"""The model stage (rule model): hub id, local folder or seeded init -> model folder, of any
supported family (distlm.family), written with that family's architecture."""

from __future__ import annotations

from pathlib import Path

from distlm import DistlmError
from distlm.family import model_args
from distlm.model.documents import ModelMeta
from distlm.model.folder import verify_model_folder, write_model_dir
from distlm.model.layout import DTYPES, META
from distlm.model.source import init_config, init_model, load_source, state_dict_for_save
from distlm.settings.model import ModelConfig


def serialize(
    cfg: ModelConfig, *, tokenizer_dir: Path, tokens_path: Path, out_dir: Path
) -> ModelMeta:
    """The model stage (`model`): hub id / local folder / seeded init -> model folder.

    A local folder that distlm wrote (it has distlm.json) is verified on import
    (`verify_model_folder`); a Hugging Face folder has no hash to check, and the folder this
    stage writes carries one from here on."""
    from distlm.data import read_tokens_meta as read_data_meta

    mcfg = cfg.model
    data_meta = read_data_meta(tokens_path)
    vocab = data_meta.vocab_size
    if mcfg.source == "local" and mcfg.name and (Path(mcfg.name) / META).is_file():
        verify_model_folder(mcfg.name)
    if mcfg.source == "init":
        config = init_config(mcfg.init, vocab, data_meta.eos_token_id)
        model = init_model(config, seed=mcfg.init.seed)
        source = {"kind": "init", "seed": mcfg.init.seed}
    else:
        model = load_source(mcfg)
        config = model.config
        source = mcfg.model_dump(include={"source", "name", "revision"})
        if config.vocab_size < vocab:
            raise DistlmError(
                f"model.name {mcfg.name!r} has vocab_size {config.vocab_size} but the tokenizer in "
                f"{tokenizer_dir} has {vocab} tokens"
            )
    n_positions = model_args(config.to_dict(), f"model.name {mcfg.name or 'init'}").context
    if data_meta.block_size > n_positions:
        raise DistlmError(
            f"data.block_size: {data_meta.block_size} ({tokens_path}) is beyond model "
            f"{mcfg.name or 'init'}'s context of {n_positions}"
        )
    model = model.to(DTYPES[mcfg.dtype])  # pyright: ignore[reportArgumentType] (as above)
    sd = state_dict_for_save(model)
    meta = {
        "created_by": "model",
        "source": source,
        "config_digest": cfg.digest,  # the stage config's, as the rule's params hold it
        "data_config_digest": data_meta.config_digest,
        "dtype": mcfg.dtype,
    }
    return write_model_dir(
        out_dir, state_dict=sd, config=config, tokenizer_dir=tokenizer_dir, meta=meta
    )
