"""Model folders: safetensors weights, config.json, tokenizer files and distlm.json (a `ModelMeta`
document), written atomically and loaded into distlm's model of the family with their sha256,
format and tensor shapes checked.

`verify_model_folder` is the one check of a folder's weights against its distlm.json: every stage
that reads a model folder goes through it (load_model_dir, the broadcast stage, the shard stage)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.core.documents import read_document, write_document
from distlm.core.io import atomic_dir, check_sha256, digest, nbytes, sha256_file, tree_bytes
from distlm.core.log import get_logger
from distlm.family import ModelArgs, family_of, model_args
from distlm.family.transformer import Transformer
from distlm.model.documents import ModelMeta
from distlm.model.layout import CONFIG, GENERATION_CONFIG, META, WEIGHTS

log = get_logger(__name__)


def load_safetensors(path: str | Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file; a corrupt or truncated file gets an error that names it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DistlmError(f"weights file not found: {path}")
    try:
        return load_file(str(path), device=device)
    except Exception as e:
        raise DistlmError(
            f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e})"
        ) from None


# The metadata of every safetensors file distlm writes: transformers reads "format". One key, so
# that the file's bytes are a function of its tensors (safetensors writes its metadata from a hash
# map, whose order with several keys changes from process to process): the same weights, the same
# sha256, written or pushed (safetensors_sha256).
SAFETENSORS_METADATA = {"format": "pt"}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=SAFETENSORS_METADATA
    )


def safetensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The sha256 of the file `save_safetensors(tensors, path)` writes, without writing it: what
    names weights that are pushed, not read from a file (distlm.train.pushes)."""
    import hashlib

    from safetensors.torch import save

    return hashlib.sha256(
        save({k: v.contiguous() for k, v in tensors.items()}, metadata=SAFETENSORS_METADATA)
    ).hexdigest()


def read_config(folder: str | Path) -> dict:
    """config.json of a model or pipeline folder, as the mapping it holds."""
    from distlm.core.io import read_json

    p = Path(folder) / CONFIG
    if not p.is_file():
        raise DistlmError(f"model config not found: {p}")
    doc = read_json(p, what="model config")
    if not isinstance(doc, dict):
        raise DistlmError(f"{p}: not a model config (a JSON object)")
    return doc


def read_args(folder: str | Path) -> ModelArgs:
    """What distlm's model of a folder is built from: its config.json through its family's
    config mapping (no transformers); a model_type distlm does not support, or a key its model
    cannot run, is refused naming the file."""
    return model_args(read_config(folder), str(Path(folder) / CONFIG))


def load_model_dir(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> Transformer:
    """distlm's model of a model folder (eval mode), its weights checked against distlm.json's
    sha256 and, tensor by tensor, against the config's shapes. `verify=False` skips the sha256
    (a folder not written by distlm: a Hugging Face folder)."""
    folder = Path(folder)
    args = read_args(folder)
    weights = folder / WEIGHTS
    if verify:
        verify_model_folder(folder)
    tensors = load_safetensors(weights)
    model = family_of(args).build(args, device=device, dtype=dtype)
    model.load_hf(tensors, str(weights))
    return model.eval()


def read_meta(folder: str | Path) -> ModelMeta:
    """distlm.json of a model folder (the model stage's or training's final): the one reader."""
    return read_document(Path(folder) / META, ModelMeta)


def verify_model_folder(folder: str | Path) -> ModelMeta:
    """The folder's metadata, after checking that its weights are the ones it names.

    The one rule: a folder distlm wrote carries the sha256 of its weights (ModelMeta requires
    it), and the weights must match it. A folder without distlm.json, or whose distlm.json has
    no hash, is refused naming the file; a folder from elsewhere enters through the model stage
    (model.source: local), which writes a verified one."""
    folder = Path(folder)
    meta = read_meta(folder)
    check_sha256(
        folder / WEIGHTS,
        meta.model_sha256,
        named_by=f"{folder / META} ({meta.model_sha256}); the folder was changed after it was "
        "written: rerun the stage that wrote it",
        missing=f"weights file not found (named by {folder / META})",
    )
    return meta


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_model_dir(
    out_dir: str | Path,
    *,
    state_dict: dict[str, torch.Tensor],
    config=None,
    config_from: str | Path | None = None,
    tokenizer_dir: str | Path,
    meta: dict,
    extra_files: dict[str, Path] | None = None,
) -> ModelMeta:
    """Write a complete model folder (atomically: all or nothing) and return its metadata.
    `state_dict`: transformers-named tensors. Its config.json is `config`'s (a transformers
    config: the model stage, which saves it as the family's `save_pretrained` does) or a copy of
    `config_from`'s (a model folder of the same architecture and dtype: training's final folder
    is its base's, so no rank needs transformers). `meta`: the writer's part of the metadata
    (created_by, source, config and data digests, dtype and, from training, the training
    record); the weights' hash and shape figures are added here."""
    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir)
    if (config is None) == (config_from is None):
        raise ValueError("write_model_dir: give config or config_from")
    if not tokenizer_dir.is_dir():
        raise DistlmError(f"tokenizer folder not found: {tokenizer_dir}")
    size = nbytes(state_dict) + sum(
        tree_bytes(Path(p)) for p in (tokenizer_dir, *(extra_files or {}).values())
    )
    with atomic_dir(out_dir, size=size) as tmp:
        save_safetensors(state_dict, tmp / WEIGHTS)
        if config_from is not None:
            for name in (CONFIG, GENERATION_CONFIG):
                if (Path(config_from) / name).is_file():
                    shutil.copy2(Path(config_from) / name, tmp / name)
        else:
            save_config(config, tmp, dtype=next(iter(state_dict.values())).dtype)
        copy_files(tokenizer_dir, tmp)
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
        args = read_args(tmp)
        full_meta = ModelMeta(
            **meta,
            model_sha256=sha256_file(tmp / WEIGHTS),
            n_layer=args.n_layers,
            n_positions=args.context,
            vocab_size=args.vocab_size,
            parameters=sum(t.numel() for t in state_dict.values()),
            arch_digest=digest(args.signature()),
        )
        write_document(tmp / META, full_meta)
    log.info(
        "wrote %s: %d tensors, %.1f MB",
        out_dir,
        len(state_dict),
        nbytes(state_dict) / 1e6,
    )
    return full_meta


def save_config(config, folder: Path, *, dtype: torch.dtype) -> None:
    """config.json and generation_config.json as the family's `save_pretrained` writes them.

    `architectures` is what the ecosystem picks the model class by (`transformers serve` does
    `getattr(transformers, config.architectures[0])`, and so does vLLM); a config built from
    scratch (model.source init) has none until a model saves it."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    config.architectures = [family_of(config).architecture]
    config.dtype = dtype
    config.save_pretrained(folder)
    gen = GenerationConfig.from_model_config(config)
    gen._from_model_config = True  # as save_pretrained marks it: defaults, no user settings
    gen.save_pretrained(folder)


def copy_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy2(f, dst / f.name)
