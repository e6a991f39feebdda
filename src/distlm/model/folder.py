"""Model folders: safetensors weights, config.json, tokenizer files and distlm.json (a `ModelMeta`
document), written atomically and loaded with their sha256, format and tensor shapes checked.

`verify_model_folder` is the one check of a folder's weights against its distlm.json: every stage
that reads a model folder goes through it (load_model_dir, the broadcast stage, the shard stage)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from distlm import DistlmError
from distlm.documents import ModelMeta, read_document, write_document
from distlm.family import family_of
from distlm.io import atomic_dir, digest, nbytes, sha256_file, tree_bytes
from distlm.log import get_logger
from distlm.model.build import build_model
from distlm.model.layout import (
    META,
    WEIGHTS,
)

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


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_config_json(folder: str | Path):
    """The transformers config of a model or pipeline folder, of its family's config class; a
    model_type distlm does not support is refused naming the supported ones."""
    from distlm.io import read_json

    p = Path(folder) / "config.json"
    if not p.is_file():
        raise DistlmError(f"model config not found: {p}")
    doc = read_json(p, what="model config")
    family = family_of(doc.get("model_type") if isinstance(doc, dict) else None, where=str(p))
    try:
        return family.config_class.from_json_file(str(p))
    except Exception as e:
        raise DistlmError(f"{p}: not a readable {family.model_type} config ({e})") from None


def check_state_dict(
    sd: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str
) -> None:
    """Names, shapes and dtypes of `sd` must match `expected`; the error names the tensor."""
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing:
        raise DistlmError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    if extra:
        raise DistlmError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected)")
    for k, v in expected.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise DistlmError(
                f"{where}: tensor {k!r} has shape {tuple(sd[k].shape)}, config expects {tuple(v.shape)}"
            )


def load_model_dir(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype=None, verify: bool = True
):
    """Load a model folder into its family's model (eval mode); checks digest and tensor shapes.
    `verify=False` skips the digest (a folder not written by distlm: a Hugging Face folder)."""
    folder = Path(folder)
    config = load_config_json(folder)
    weights = folder / WEIGHTS
    if verify:
        verify_model_folder(folder)
    sd = load_safetensors(weights)
    with torch.device("meta"):
        model = build_model(config)
    tied = family_of(config).tied(config)
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    check_state_dict(sd, expected, str(weights))
    model = build_model(config)
    model.load_state_dict(sd, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    # transformers' decorated PreTrainedModel.to loses `self` in its stub
    return model.to(device).eval()  # pyright: ignore[reportArgumentType]


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
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise DistlmError(f"{weights}: weights file not found (named by {folder / META})")
    actual = sha256_file(weights)
    if actual != meta.model_sha256:
        raise DistlmError(
            f"{weights}: sha256 {actual} does not match {folder / META} ({meta.model_sha256}); "
            "the folder was changed after it was written: rerun the stage that wrote it"
        )
    return meta


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_model_dir(
    out_dir: str | Path,
    *,
    state_dict: dict[str, torch.Tensor],
    config,
    tokenizer_dir: str | Path,
    meta: dict,
    extra_files: dict[str, Path] | None = None,
) -> ModelMeta:
    """Write a complete model folder (atomically: all or nothing) and return its metadata.
    `meta`: the writer's part of it (created_by, source, config and data digests, dtype and,
    from training, the training record); the weights' hash and shape figures are added here."""
    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise DistlmError(f"tokenizer folder not found: {tokenizer_dir}")
    size = nbytes(state_dict) + sum(
        tree_bytes(Path(p)) for p in (tokenizer_dir, *(extra_files or {}).values())
    )
    family = family_of(config)
    with atomic_dir(out_dir, size=size) as tmp:
        save_safetensors(state_dict, tmp / WEIGHTS, metadata={"format": "pt"})
        save_config(config, tmp, dtype=next(iter(state_dict.values())).dtype)
        copy_files(tokenizer_dir, tmp)
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
        full_meta = ModelMeta(
            **meta,
            model_sha256=sha256_file(tmp / WEIGHTS),
            n_layer=family.n_layer(config),
            n_positions=family.n_positions(config),
            vocab_size=config.vocab_size,
            parameters=sum(t.numel() for t in state_dict.values()),
            arch_digest=digest(arch_signature(config)),
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


def arch_signature(config) -> dict:
    """What must agree between a checkpoint and the model it claims to be (the family's)."""
    return family_of(config).signature(config)
