"""Tokenizers: a byte-level BPE trained on a sample of the corpus, a named one, or the model's own
(`data.tokenizer`); loading a saved one; the encoder a tokenize job runs (`Encoder`: the saved
folder's tokenizers-library tokenizer, without transformers)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from distlm import DistlmError
from distlm.core.log import get_logger
from distlm.data.sources import EOS
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


def named_tokenizer(name: str, vocab_size: int):
    """The tokenizer `data.tokenizer.name` gives a random init (a hub id or a tokenizer folder);
    refused when it has more ids than data.tokenizer.vocab_size, which the checks before any job
    size the model by."""
    from transformers import AutoTokenizer

    local = Path(name).is_dir()
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=local)
    except Exception as e:
        raise DistlmError(
            f"data.tokenizer.name {name!r}: could not load the tokenizer ({type(e).__name__}: "
            f"{e})" + ("" if local else ". Unknown id, or offline without a cached copy?")
        ) from None
    if len(tok) > vocab_size:
        raise DistlmError(
            f"data.tokenizer.vocab_size: {vocab_size} is smaller than tokenizer {name!r}'s "
            f"{len(tok)} ids; set it to at least {len(tok)}"
        )
    return tok


class Encoder:
    """A saved tokenizer folder's `tokenizer.json`, run by the tokenizers library itself: the ids
    transformers' tokenizer of the folder gives (`tok(texts, add_special_tokens=False)`), without
    its offsets or its import. `threads`: the library's worker threads."""

    def __init__(self, folder: str | Path, threads: int = 1) -> None:
        import os

        os.environ["RAYON_NUM_THREADS"] = str(max(1, threads))  # read when its pool starts
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
        from tokenizers import Tokenizer

        path = Path(folder) / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DistlmError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
