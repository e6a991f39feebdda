"""Tokenizers: a byte-level BPE trained on the corpus, or the model's own (`data.tokenizer`);
loading a saved one; encoding a split into one token stream."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from distlm import DistlmError
from distlm.core.log import get_logger, progress
from distlm.data.sources import EOS, Split
from distlm.settings import ModelSourceSettings
from distlm.settings.model import SUPPORTED_MODEL_TYPES

log = get_logger(__name__)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int, out_dir: Path):
    """A byte-level BPE (GPT-2's scheme) trained on the train split, saved in HF format."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    tok.save_pretrained(out_dir)
    return tok


def model_tokenizer(model_cfg: ModelSourceSettings):
    """The model's own tokenizer (hub id or local folder), or None for a random init. The first
    stage to read a hub model: a model_type distlm does not support is refused here, before any
    data is tokenized (a local folder's was refused when the config was validated)."""
    from transformers import AutoConfig, AutoTokenizer

    if model_cfg.source == "init":
        return None
    name = model_cfg.name
    local = model_cfg.source == "local"
    if not name:  # Settings refuses this
        raise DistlmError(f"model.name: required when model.source is {model_cfg.source}")
    if local and not Path(name).is_dir():
        raise DistlmError(f"model.name: model folder not found: {name}")
    try:
        model_type = AutoConfig.from_pretrained(
            name, revision=model_cfg.revision, local_files_only=local
        ).model_type
    except Exception as e:
        raise DistlmError(
            f"model.name {name!r}: could not read the model's config ({type(e).__name__}: {e}). "
            + ("" if local else "Unknown model id, or offline without a cached copy?")
        ) from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DistlmError(
            f"model.name {name!r}: model_type {model_type!r} is not supported; distlm supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        return AutoTokenizer.from_pretrained(
            name, revision=model_cfg.revision, local_files_only=local
        )
    except Exception as e:
        raise DistlmError(
            f"model.name {name!r}: could not load its tokenizer ({type(e).__name__}: {e}). "
            + ("" if local else "Unknown model id, or offline without a cached copy?")
        ) from None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise DistlmError(
            f"tokenizer folder {path} cannot be loaded ({type(e).__name__}: {e})"
        ) from None


def encode(tok, split: Split, separator: str, *, show: bool = True) -> np.ndarray:
    """Token ids of the split's records joined by `separator` (tokenized record by record)."""
    pieces = [r + separator for r in split.records[:-1]] + split.records[-1:]
    ids: list[np.ndarray] = []
    batch = 256
    bar = progress(
        range(0, len(pieces), batch), enabled=show, desc=f"tokenize {split.name}", unit="batch"
    )
    for i in bar:
        enc = tok(pieces[i : i + batch], add_special_tokens=False)["input_ids"]
        ids.extend(np.asarray(e, dtype=np.int64) for e in enc if len(e))
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
